"""What ``host_bench`` reports of its samples: the paired ratios, the floors and the summary.

The variants' names are ``<mode>_<tag>`` (``COMPILES``: eager, per layer, per chunk) and
``plain_<eager|compiled|whole>``; ``ratios`` pairs each mode with its baseline and the baseline
with the plain GPT, ``floors`` checks the floors of issue 36 on the path ``auto`` takes on a
GPU (ours per chunk) from the samples of the floors' own interleaved run, and ``markdown``
writes the summary's section (``bench.run``).
"""

from __future__ import annotations

from bench.paired import paired_interval, paired_ratio

# variant tag -> runtime.compile: eager, one graph per layer, one graph per chunk
COMPILES = {"eager": "off", "compiled": "layer", "chunk": "chunk"}
FLOORS = {"block_over_baseline_host": 1.10, "block_over_baseline_ops": 1.2}
FLOOR_BASELINE_OVER_PLAIN = 1.2
# the floors on auto's GPU path, measured on their own: (label, numerator, denominator,
# host time or aten ops, floor)
_BLOCK, _BASE = "block_chunk", "baseline_chunk"
FLOOR_ROWS = (
    ("Block / baseline", _BLOCK, _BASE, "host", FLOORS["block_over_baseline_host"]),
    ("Block / baseline", _BLOCK, _BASE, "ops", FLOORS["block_over_baseline_ops"]),
    ("baseline / plain GPT whole", _BASE, "plain_whole", "host", FLOOR_BASELINE_OVER_PLAIN),
    ("baseline / plain GPT per block", _BASE, "plain_compiled", "host", FLOOR_BASELINE_OVER_PLAIN),
)
# the variants the floors compare, each once
FLOOR_VARIANTS = tuple(dict.fromkeys(name for row in FLOOR_ROWS for name in row[1:3]))


def ratio_of(samples: dict, num: str, den: str, key: str) -> dict:
    a, b = samples[num][key], samples[den][key]
    return {"ratio": paired_ratio(a, b), "interval": paired_interval(a, b)}


def ratios(samples: dict, ops: dict) -> dict:
    """Paired host-time ratios (and op ratios) of each mode over its baseline and of the
    baseline over the plain GPT: per layer and per chunk against the plain GPT per block
    (torchtitan's), and per chunk also against the plain GPT compiled whole."""
    out = {}
    for tag in COMPILES:
        for mode in ("block", "full"):
            out[f"{mode}_over_baseline_{tag}"] = _pair(
                samples, ops, f"{mode}_{tag}", f"baseline_{tag}"
            )
        plain = "plain_eager" if tag == "eager" else "plain_compiled"
        out[f"baseline_over_plain_{tag}"] = _pair(samples, ops, f"baseline_{tag}", plain)
    out["baseline_chunk_over_plain_whole"] = _pair(samples, ops, "baseline_chunk", "plain_whole")
    return out


def floors(samples: dict, ops: dict) -> list[dict]:
    """Each floor of ``FLOOR_ROWS``: its paired ratio (host time) or op ratio, the floor, and
    whether the ratio is within it and the whole 95% interval too."""
    rows = []
    for label, num, den, kind, floor in FLOOR_ROWS:
        row = {"label": label, "kind": kind, "floor": floor}
        if kind == "host":
            row |= ratio_of(samples, num, den, "host_ms")
            interval = row["interval"]
            row["interval_within"] = interval is not None and interval[1] <= floor
        else:
            row |= {"ratio": ops[num] / ops[den], "interval": None, "interval_within": True}
        row["within"] = row["ratio"] <= floor
        rows.append(row)
    return rows


def _pair(samples: dict, ops: dict, num: str, den: str) -> dict:
    return {"host": ratio_of(samples, num, den, "host_ms"), "ops": ops[num] / ops[den]}


def _cell(r: dict) -> str:
    interval = r["interval"]
    within = "" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]"
    return f"{r['ratio']:.2f}{within}"


def markdown(result: dict) -> list[str]:
    """The summary's section (``bench.run``): a table and the floors."""
    c, v, r = result["config"], result["variants"], result["ratios"]
    lines = [
        "",
        "## Host work per training step at almost no arithmetic (CPU proxy)",
        "",
        f"{c['layers_x_hidden']}, 1 x {c['seq']} tokens, one thread; ours: DeepSpeed's bf16 "
        "engine at pp = 1 (`train_batch`), compiled per layer (`runtime.compile: layer`) or per "
        "chunk (`chunk`: all layers one graph); plain GPT: a torch AdamW loop under bf16 "
        "autocast, compiled per block (torchtitan's) or whole (its loss one graph); "
        f"compiled: `{c['backend']}`. Host time = process CPU time per step (median); "
        "ratios paired, 95% intervals in brackets.",
        "",
        "| variant | host ms: eager | per layer (plain: block) | per chunk (plain: whole) | "
        "aten ops: eager | per layer | per chunk |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("baseline", "block", "full", "plain"):
        tags = ("eager", "compiled", "whole" if name == "plain" else "chunk")
        cells = [v[f"{name}_{t}"] for t in tags]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{x['host_ms']:.1f}" for x in cells)
            + " | "
            + " | ".join(str(x["aten_ops"]) for x in cells)
            + " |"
        )
    lines += [
        "",
        "| ratio | eager | per layer | per chunk | floor (compiled) |",
        "|---|---|---|---|---|",
    ]
    bounds = {
        ("block", "host"): f"<= {FLOORS['block_over_baseline_host']}",
        ("block", "ops"): f"<= {FLOORS['block_over_baseline_ops']}",
        ("baseline", "host"): f"<= {FLOOR_BASELINE_OVER_PLAIN}",
    }
    for key, label in (("block", "Block / baseline"), ("full", "Full / baseline")):
        for kind in ("host", "ops"):
            row = [r[f"{key}_over_baseline_{t}"][kind] for t in COMPILES]
            lines.append(_row(f"{label}, {_KIND[kind]}", row, kind, bounds.get((key, kind), "")))
    for kind in ("host", "ops"):
        row = [r[f"baseline_over_plain_{t}"][kind] for t in COMPILES]
        floor = bounds.get(("baseline", kind), "")
        lines.append(_row(f"baseline / plain GPT per block, {_KIND[kind]}", row, kind, floor))
    whole = r["baseline_chunk_over_plain_whole"]
    lines.append(
        f"| baseline per chunk / plain GPT whole, host time | | | {_cell(whole['host'])} | "
        f"<= {FLOOR_BASELINE_OVER_PLAIN} |"
    )
    if result.get("floors"):
        reps = len(result["floor_samples"]["baseline_chunk"]["host_ms"])
        lines += [
            "",
            "Floors on the path `auto` takes on a GPU (ours per chunk), measured on their own: "
            f"those variants interleaved among themselves, {reps} repetitions.",
            "",
            "| ratio | value | floor | within | 95% interval within |",
            "|---|---|---|---|---|",
        ]
        for f in result["floors"]:
            value = _cell(f) if f["kind"] == "host" else f"{f['ratio']:.2f}"
            lines.append(
                f"| {f['label']}, {_KIND[f['kind']]} | {value} | <= {f['floor']} | "
                f"{'yes' if f['within'] else 'no'} | "
                f"{'yes' if f['interval_within'] else 'no'} |"
            )
    reads = {n: x["host_reads"] for n, x in v.items() if "host_reads" in x}
    if reads:
        some = ", ".join(f"{n} {k}" for n, k in reads.items() if k) or "none in any variant"
        lines += ["", f"Host reads of a tensor value per eager step (on a GPU, waits): {some}."]
    guards = result.get("steady_over_every_guard")
    if guards:
        lines += [
            "",
            "Compiled per layer, host time with steady guards (`runtime.guards: auto`) over "
            "every guard on every call (`full`): "
            + ", ".join(f"{name} {_cell(r)}" for name, r in guards.items())
            + ".",
        ]
    return lines


_KIND = {"host": "host time", "ops": "aten ops"}


def _row(label: str, cells: list, kind: str, floor: str) -> str:
    text = [_cell(x) if kind == "host" else f"{x:.2f}" for x in cells]
    return f"| {label} | " + " | ".join(text) + f" | {floor} |"
