"""docs/gpu.md from the GPU check's records (``gpu_check.run``); standard library only."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_check import speed_report

RUN = (
    "make gpu-wheels   # once, on a CPU machine with network: .whl/ (git-ignored, ~50 MB)\n"
    "# then, from the session that has a GPU, the device tool's run with\n"
    '#   command:   "bash launch/gpu_check.sh"\n'
    '#   carry:     [".whl"]\n'
    "#   timeout_s: 540\n"
    "# and copy the returned gpu.md over docs/gpu.md"
)


def _cell(value) -> str:
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out + [""]


def _by_name(summary: dict) -> dict:
    return {r["name"]: r for r in summary["steps"]}


def _result(steps: dict, name: str) -> dict:
    return steps.get(name, {}).get("result") or {}


def _machine(steps: dict) -> list[str]:
    m = _result(steps, "machine")
    if not m:
        return ["(the machine step did not run)", ""]
    out = [f"- Python {m.get('python')}; {m.get('platform')}; {m.get('cpus')} CPUs"]
    gpu = m.get("gpu")
    if gpu:
        out.append(
            f"- GPU: {gpu['name']}, compute capability {gpu['capability']}, "
            f"{gpu['memory_gib']} GiB, {gpu['multiprocessors']} SMs, bf16 {gpu['bf16']}"
        )
    else:
        out.append(f"- no CUDA device (torch CUDA build: {m.get('torch_cuda')})")
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if v)
    missing = ", ".join(k for k, v in m.get("versions", {}).items() if not v)
    out += [f"- installed: {versions}", f"- not installed: {missing or 'none'}"]
    out.append(
        f"- DeepSpeed's accelerator: {m.get('deepspeed_accelerator')}; the run's collective "
        f"device: {m.get('comm_device')}"
    )
    out += [f"- {m.get('runtime_auto')}", "", "```", *m.get("nvidia_smi", []), "```", ""]
    return out


def _training(steps: dict) -> list[str]:
    rows = []
    tiny = _result(steps, "train_tiny")
    runs = [(f"tiny ({spec})", r) for spec, r in tiny.items()]
    if _result(steps, "train_125m"):
        runs.append(("gpt-125m shape (local)", _result(steps, "train_125m")))
    for label, r in runs:
        if "skipped" in r:
            rows.append([label, "skipped: " + r["skipped"], "", "", "", "", ""])
            continue
        rows.append(
            [
                label,
                r["runtime"].removeprefix("runtime: "),
                r["steps"],
                f"{r['first_loss']} -> {r['final_loss']} (valid {r['valid_loss']})",
                r["tokens_per_s"],
                r["peak_gib"],
                f"{r['parameters']:,}",
            ]
        )
    header = ["run", "runtime", "steps", "loss", "tokens/s", "peak GiB", "parameters"]
    return _table(header, rows) if rows else ["(no training step ran)", ""]


def _step_time(steps: dict) -> list[str]:
    r = _result(steps, "step_time")
    if not r:
        return ["(the step-time step did not run)", ""]
    rows = [
        [mode, r[mode]["model"], r[mode]["step_ms"], r[mode]["vs_baseline"], r[mode]["peak_gib"]]
        for mode in ("baseline", "block", "full", "moe_baseline", "moe_block")
        if mode in r
    ]
    out = [
        f"Shape: {r.get('shape')}; median of the measured steps. The MoE rows (8 experts of "
        "width 768, top-2, the first layer dense) are against the MoE baseline.",
        "",
    ]
    return out + _table(["mode", "model", "ms / step", "vs baseline", "peak GiB"], rows)


def _step_profile(steps: dict) -> list[str]:
    r = _result(steps, "step_profile")
    if not r:
        return ["(not run: `--only step_profile` runs it)", ""]
    runs = [x for x in r.get("runs", []) if "step_ms" in x]
    base = next((x["step_ms"] for x in runs if x["mode"] == "baseline"), None)
    rows = [
        [
            x["mode"],
            x["impl"],
            x.get("step_ms", ""),
            round(x["step_ms"] / base, 3) if base and "step_ms" in x else "",
            x.get("busy_ms", ""),
            "; ".join(f"{t['op'][:40]} {t['ms']}" for t in x.get("top", [])[:4]),
            x.get("skipped", ""),
        ]
        for x in r.get("runs", [])
    ]
    header = ["mode", "impl", "ms / step", "vs baseline", "device busy ms", "top kernels (ms)"]
    out = [f"Shape: {r.get('shape')}. {r.get('cut', '')}", ""]
    out += _table([*header, "skipped"], rows)
    host = [[x["mode"], x["impl"], *_host_cells(x)] for x in runs if "host" in x or "sync" in x]
    if host:
        out += [
            "Host side per step: CUDA runtime calls, kernel launches, calls that block the",
            "host (and its ms inside them), synchronising torch calls and where they are.",
            "",
        ]
        header = ["mode", "impl", "runtime calls", "launches", "blocking (ms)", "syncs", "sites"]
        out += _table(header, host)
    return out


def _host_cells(x: dict) -> list:
    h, s = x.get("host", {}), x.get("sync", {})
    calls = h.get("blocking", {})
    blocking = "; ".join(f"{k} {v['calls']:g} ({v['ms']})" for k, v in calls.items())
    return [
        h.get("runtime_calls", h.get("error", "")),
        h.get("launches", ""),
        blocking or ("0" if "blocking" in h else ""),
        s.get("syncs", s.get("error", "")),
        "; ".join(s.get("sites", [])),
    ]


def _depth_attention(steps: dict) -> list[str]:
    r = _result(steps, "depth_attention")
    if not r:
        return ["(the depth-attention step did not run)", ""]
    kb = r.get("kernel_bench")
    out = [f"`bench.kernel_bench.run`: {kb if isinstance(kb, str) else 'ran, result below'}", ""]
    rows = [
        [
            x["impl"],
            x.get("device", ""),
            x.get("dtype", ""),
            x.get("shape", ""),
            x.get("fwd_bwd_ms", ""),
            x.get("peak_extra_mib", ""),
            x.get("skipped", ""),
        ]
        for x in r.get("registry", [])
    ]
    header = ["impl", "device", "dtype", "[n, tokens, d]", "fwd+bwd ms", "peak MiB", "skipped"]
    out += _table(header, rows)
    if not isinstance(kb, str) and kb is not None:
        out += ["```json", json.dumps(kb, indent=1)[:6000], "```", ""]
    return out


def _generate(steps: dict) -> list[str]:
    r = _result(steps, "generate")
    if not r:
        return ["(the generate step did not run)", ""]
    kv, rec = r.get("kv_cache", {}), r.get("recompute", {})
    out = [
        f"Greedy generation on {r['device']}: the Hugging Face model with its KV cache "
        f"{kv.get('tokens_per_s')} tokens/s, the native model recomputing the window "
        f"{rec.get('tokens_per_s')} tokens/s ({kv.get('tokens')} tokens). Export layer spec: "
        f"{r.get('layer_spec')}.",
        "",
    ]
    for cli in r.get("cli", []):
        text = cli["text"].strip().replace("`", "'")[:200]
        out.append(f"- `generate --device {cli['device']}` ({cli['wall_s']} s): `{text}`")
    return out + [""]


def _study(steps: dict) -> list[str]:
    """The GPU study's plan and runs (the archive holds the full results)."""
    r = _result(steps, "study")
    corpus, plan = r.get("corpus", {}), r.get("plan", {})
    lines = []
    if corpus:
        lines += [
            f"Corpus: {corpus['files']:,} installed Python files, {corpus['train_tokens']:,} + "
            f"{corpus['valid_tokens']:,} byte tokens (train + valid) in {corpus['seconds']} s; "
            f"file list sha256 `{corpus['file_list_sha256'][:16]}`.",
            "",
        ]
    if plan:
        cal = plan["calibration"]
        lines += [
            f"Plan: {plan['steps']} steps per run ({r.get('tokens_per_run', 0):,} tokens) at "
            f"learning rates {', '.join(f'{lr:g}' for lr in plan['lrs'])}, from a calibration "
            f"run of Full AttnRes ({cal['startup_s']} s start-up, {cal['step_s']} s per step).",
            "",
        ]
    rows = [
        [x["run"], x["final_valid_loss"], x["tokens_per_s"], x["wall_s"]] for x in r.get("runs", [])
    ]
    if rows:
        lines += _table(["run", "final validation loss", "tokens/s", "wall s"], rows)
        lines += [
            f"Noise (baseline's last validation losses, max - min): {r.get('noise_last_evals')}. "
            f"Results, figures and run files: `{Path(r.get('archive', 'study.tar.gz')).name}`.",
            "",
        ]
    return lines


def _speed(steps: dict) -> list[str]:
    """The speed steps' tables (``speed_report``), those that ran."""
    out = []
    for name in ("speed_125m", "speed_125m_compiled", "speed_1b"):
        r = _result(steps, name)
        if r.get("ceilings"):
            out += speed_report.markdown(r, _table)
    return out


def markdown(summary: dict) -> str:
    steps = _by_name(summary)
    title = "GPU check (dry run on a CPU)" if summary["dry_run"] else "GPU check"
    out = [
        f"# {title}",
        "",
        f"Written by `make gpu-check` (gpu_check/) on {summary['started']}: "
        f"{summary['wall_s']} s of a {summary['budget_s']:.0f} s budget. Base Python "
        f"{summary['base_python']}; carried wheels: {', '.join(summary['wheels']) or 'none'}.",
        "",
        "## Steps",
        "",
    ]
    rows = [
        [s["name"], s["status"], s.get("seconds", ""), s["what"], s.get("note", "")]
        for s in summary["steps"]
    ]
    out += _table(["step", "status", "seconds", "what", "note"], rows)
    side = sorted({s.get("lane", 0) for s in summary["steps"]} - {0})
    if len(side) > 1:
        lanes = [
            ", ".join(s["name"] for s in summary["steps"] if s.get("lane", 0) == k) for k in side
        ]
        out += [f"These ran side by side: {' | '.join(lanes)}; the rest ran alone.", ""]
    for s in summary["steps"]:
        if s["status"] in ("failed", "timeout") and s.get("tail"):
            out += [f"`{s['name']}` {s['status']}; the end of its output:", "", "```"]
            out += [*s["tail"].strip().splitlines()[-15:], "```", ""]
    out += ["## Machine", "", *_machine(steps)]
    cuda = _result(steps, "cuda_tests")
    out += ["## CUDA-marked tests", "", f"`pytest -m cuda`: {cuda.get('summary', 'did not run')}"]
    out += ["", "## Training smoke (one GPU)", "", *_training(steps)]
    out += ["## Step time: AttnRes vs baseline", "", *_step_time(steps)]
    out += ["## Where the step's time goes", "", *_step_profile(steps)]
    out += ["## Depth attention", "", *_depth_attention(steps)]
    out += ["## Generate", "", *_generate(steps)]
    if any(name.startswith("speed") for name in steps):
        out += ["## Speed: eager, compiled, graphed, against a plain GPT", "", *_speed(steps)]
    if "study" in steps:
        out += ["## Study: baseline vs Block vs Full AttnRes", "", *_study(steps)]
    out += ["## Running it", "", "```", RUN, "```", ""]
    return "\n".join(out)
