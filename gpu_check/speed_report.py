"""The speed steps' numbers derived from their rows, the floors they are held to, and their
section of gpu.md. Standard library only (``report.py`` imports it before any install).

``derive`` turns a speed result's rows into tokens/s, MFU (model FLOPs over the step time, over
the matrix rate measured in the same run), each row's ratio to the baseline of the same
micro-batch and path, Block's time beyond the baseline against its bytes floor, and the checks
of ``FLOORS`` (issue 36 item 6): each with its limit beside the measured value. A mode stands
for the fastest of its paths that ran (eager, compiled, graphed).
"""

from __future__ import annotations

# (what, step, index into the shape's micro-batch sizes (None: decode), mode, reference, limit,
# kind). at_most: mode's time / reference's time <= limit; at_least: reference's tokens/s /
# mode's tokens/s >= limit (the baseline against the plain GPT).
FLOORS = (
    ("Block / baseline step time", "speed_125m", 0, "block", "baseline", 1.10, "at_most"),
    ("Block / baseline step time", "speed_125m", 1, "block", "baseline", 1.15, "at_most"),
    ("Full / baseline step time", "speed_125m", 0, "full", "baseline", 1.20, "at_most"),
    ("baseline / plain GPT tokens/s", "speed_125m", 0, "plain", "baseline", 0.9, "at_least"),
    (
        "decode Block / baseline time per token",
        "speed_125m",
        None,
        "block",
        "baseline",
        1.05,
        "at_most",
    ),
    ("Block / baseline step time", "speed_1b", 0, "block", "baseline", 1.05, "at_most"),
    ("baseline / plain GPT tokens/s", "speed_1b", 0, "plain", "baseline", 0.9, "at_least"),
)


def _timed_rows(result: dict) -> list[dict]:
    return [r for r in result.get("rows", []) if r.get("step_s")]


def _best(rows: list[dict], mb: int, mode: str) -> dict | None:
    """The fastest row of ``mode`` at micro-batch ``mb`` (any path)."""
    mine = [r for r in rows if r["micro_batch"] == mb and r["mode"] == mode]
    return min(mine, key=lambda r: r["step_s"], default=None)


def derive(result: dict) -> dict:
    """``{"table": [...], "checks": [...]}`` from a speed result (see the module doc)."""
    seq = result["shape"]["seq"]
    rate = result["ceilings"]["matmul_tflops"] * 1e12
    floors = result.get("floors", {})
    rows = _timed_rows(result)
    table = []
    for r in rows:
        floor = floors.get(str(r["micro_batch"]), {})
        base = next(
            (
                b
                for b in rows
                if b["mode"] == "baseline"
                and b["micro_batch"] == r["micro_batch"]
                and b["path"] == (r["path"] or "eager")
            ),
            None,
        )
        line = {
            "micro_batch": r["micro_batch"],
            "mode": r["mode"],
            "path": r["path"] or "compiled (whole model)",
            "step_ms": round(1e3 * r["step_s"], 2),
            "tokens_per_s": round(r["micro_batch"] * seq / r["step_s"]),
            "mfu": round(floor["flops"] / r["step_s"] / rate, 3) if floor and rate else None,
            "vs_baseline": round(r["step_s"] / base["step_s"], 3) if base else None,
            "first_step_s": r.get("first_step_s"),
            "launches": r.get("launches"),
            "graph_launches": r.get("graph_launches"),
            "peak_gib": r.get("peak_gib"),
        }
        if r["mode"] == "block" and base and floor:
            extra_ms = 1e3 * (r["step_s"] - base["step_s"])
            line["block_extra_ms"] = round(extra_ms, 3)
            line["block_extra_vs_floor"] = round(extra_ms / floor["block_extra_floor_ms"], 2)
        table.append(line)
    return {"table": table, "checks": _checks(result, rows)}


def _checks(result: dict, rows: list[dict]) -> list[dict]:
    sizes = result["shape"]["micro_batches"]
    decode = next((r["decode"] for r in result.get("rows", []) if r.get("decode")), None)
    checks = []
    for what, step, index, mode, ref, limit, kind in FLOORS:
        if step != result["step"].removesuffix("_compiled"):
            continue
        check = {"floor": what, "micro_batch": None, "limit": limit, "kind": kind}
        if index is None:
            value = None
            if decode and all(m in decode for m in (mode, ref)):
                value = decode[ref]["tokens_per_s"] / decode[mode]["tokens_per_s"]
        else:
            mb = sizes[index]
            check["micro_batch"] = mb
            num, den = _best(rows, mb, mode), _best(rows, mb, ref)
            value = num["step_s"] / den["step_s"] if num and den else None
            if num and den:
                check["paths"] = f"{mode}: {num['path'] or 'compiled'}, {ref}: {den['path']}"
        if value is None:
            checks.append(check | {"measured": None, "holds": None})
            continue
        holds = value <= limit if kind == "at_most" else value >= limit
        checks.append(check | {"measured": round(value, 3), "holds": holds})
    return checks


def markdown(result: dict, table) -> list[str]:
    """gpu.md's lines for one speed step's result (``table``: report.py's table writer)."""
    shape, c = result["shape"], result["ceilings"]
    out = [
        f"`{result['step']}`: {shape['name']} shape ({shape['layers']} x {shape['hidden']}, "
        f"{shape['heads']} heads, sequence {shape['seq']}, Block of {shape['block_size']} "
        f"sublayers), {result['dtype']}, one device. Ceilings measured in the same run: bf16 "
        f"matrix product {c['matmul_tflops']} TFLOP/s ({c['matmul_n']}^3), device copy "
        f"{c['copy_gbs']} GB/s read + written ({c['copy_mib']} MiB) on {c['device']}.",
        "",
    ]
    floors = result.get("floors", {})
    if floors:
        rows = [
            [
                mb,
                f"{f['flops'] / 1e12:.3g}",
                f["flop_floor_ms"],
                f"{f['block_extra_bytes'] / 1e9:.3g}",
                f["block_extra_floor_ms"],
            ]
            for mb, f in floors.items()
        ]
        header = ["micro-batch", "TFLOP / step", "FLOP floor ms", "Block extra GB", "floor ms"]
        out += ["Floors, counted before timing (`bench/speed_floor.py`):", ""]
        out += table(header, rows)
    rows = [
        [
            t["micro_batch"],
            t["mode"],
            t["path"],
            t["step_ms"],
            t["tokens_per_s"],
            t["mfu"],
            t["vs_baseline"],
            t.get("block_extra_vs_floor", ""),
            t["first_step_s"],
            "" if t["launches"] is None else f"{t['launches']} / {t['graph_launches']}",
            t["peak_gib"],
        ]
        for t in result.get("table", [])
    ]
    header = [
        "mb",
        "mode",
        "path",
        "ms / step",
        "tokens/s",
        "MFU",
        "vs baseline",
        "Block extra / floor",
        "first step s",
        "launches / graphs",
        "peak GiB",
    ]
    out += table(header, rows)
    skipped = [
        f"{r['mode'] or r['kind']} {r['path']} mb {r['micro_batch']}: "
        f"{r.get('skipped') or r.get('error')}"
        for r in result.get("rows", [])
        if r.get("skipped") or r.get("error")
    ]
    if skipped:
        out += ["Not measured: " + "; ".join(skipped) + ".", ""]
    decode = next((r["decode"] for r in result.get("rows", []) if r.get("decode")), None)
    if decode:
        out += [
            "Decode (Hugging Face model, KV cache, greedy): "
            + ", ".join(f"{m} {d['tokens_per_s']} tokens/s" for m, d in decode.items()),
            "",
        ]
    checks = [
        [
            k["floor"],
            k["micro_batch"] or "",
            ("<= " if k["kind"] == "at_most" else ">= ") + str(k["limit"]),
            k["measured"],
            {True: "holds", False: "MISSED", None: "not measured"}[k["holds"]],
            k.get("paths", ""),
        ]
        for k in result.get("checks", [])
    ]
    if checks:
        out += table(["floor", "mb", "limit", "measured", "", "fastest paths"], checks)
    return out
