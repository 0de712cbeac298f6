"""The GPU check's training steps: smoke runs, step times at the 125M shape, export + generate.

All run on one GPU (``parallel.pp=1``; bf16 is DeepSpeed's bf16 engine with one stage) in bf16
with the local spec; the tiny config also with Megatron's Transformer Engine spec when TE
imports. The 125M config's dataset and GPT-2 tokenizer are not on the machine, so it trains on
the embedded byte corpus:
the shape (12 x 768, 1024 tokens, batch 8) is what is measured. A dry run (CPU) shrinks every
shape and uses fp32.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpu_check.common import dtype_override, on_gpu, peak_gib, reset_peak

REPO = Path(__file__).resolve().parents[1]
QUIET = ["output.tensorboard=false", "train.progress=false", "train.eval_every=0"]
SHAPE_125M = [
    "data.path=null",
    "data.tokenizer=bytes",
    "data.tokenizer_path=null",
    "parallel.pp=1",
    "parallel.dp=1",
    "parallel.recompute=none",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "optim.warmup_steps=2",
]
DRY_125M = [  # a dry run keeps the code path, not the size
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


def train(config: str, overrides: list[str]) -> dict:
    from attnres_dist.config import load_config
    from attnres_dist.train.trainer import Trainer

    reset_peak()
    trainer = Trainer(load_config(config, overrides))
    summary = trainer.train()
    losses = summary["train_losses"]
    return {
        "config": config,
        "overrides": overrides,
        "runtime": trainer.runtime.describe(),
        "parameters": trainer.num_parameters(),
        "steps": summary["steps"],
        "first_loss": round(losses[0], 4),
        "final_loss": round(losses[-1], 4),
        "valid_loss": round(summary["final_valid_loss"], 4),
        "tokens_per_s": summary["tokens_per_s"],
        "wall_s": summary["wall_time_s"],
        "peak_gib": peak_gib(),
    }


def _tiny_overrides(work: Path, spec: str, dry: bool) -> list[str]:
    steps = 30 if on_gpu(dry) else 3
    out = ["parallel.pp=1", f"train.steps={steps}", "train.eval_batches=2", "train.log_every=10"]
    out += [f"runtime.layer_spec={spec}", dtype_override(dry), "checkpoint.every=0", *QUIET]
    out.append("optim.warmup_steps=2")
    out.append(f"output.run_dir={work / f'tiny-{spec}'}")
    if dry:
        out += ["model.seq_length=64", "train.micro_batch_size=4", "train.global_batch_size=8"]
    return out


def train_tiny(work: Path, dry: bool) -> dict:
    from attnres_dist.runtime import probes

    runs = {"local": train("configs/tiny.yaml", _tiny_overrides(work, "local", dry))}
    te = probes.transformer_engine()
    if te.ok and on_gpu(dry):
        runs["te"] = train("configs/tiny.yaml", _tiny_overrides(work, "te", dry))
    else:
        runs["te"] = {"skipped": f"Transformer Engine spec: {te.detail}"}
    return runs


def train_125m(work: Path, dry: bool) -> dict:
    steps = 10 if on_gpu(dry) else 2
    overrides = [*SHAPE_125M, f"train.steps={steps}", "train.eval_batches=1", "train.log_every=5"]
    overrides += ["runtime.layer_spec=local", dtype_override(dry), "checkpoint.every=0", *QUIET]
    overrides += [f"output.run_dir={work / '125m'}", *(DRY_125M if dry else [])]
    return train("configs/gpt-125m.yaml", overrides)


def trainer_125m(work: Path, dry: bool, run_name: str, steps: int, *extra: str):
    """A Trainer at the 125M shape (the dry run's tiny one), local spec, run dir ``run_name``."""
    from attnres_dist.config import load_config
    from attnres_dist.train.trainer import Trainer

    overrides = [*SHAPE_125M, *extra, f"train.steps={steps}", "runtime.layer_spec=local"]
    overrides += [dtype_override(dry), *QUIET, f"output.run_dir={work / run_name}"]
    overrides += DRY_125M if dry else []
    return Trainer(load_config("configs/gpt-125m.yaml", overrides))


def step_seconds(trainer, warmup: int, reps: int) -> list[float]:
    """Wall time of each of ``reps`` optimizer steps after ``warmup`` untimed ones."""
    import torch

    times = []
    for step in range(warmup + reps):
        batch = trainer.micro_batches(step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        float(trainer.engine.train_step(batch))  # reading the loss waits for the GPU
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def shape_label(dry: bool) -> str:
    return "12 x 768, seq 1024, batch 8" if not dry else "dry-run shape"


# the 125M shape with 8 experts of width 768 (top-2: 1,536 active FFN channels against the
# dense 2,048), the first layer dense; one GPU, so no expert parallelism
MOE_125M = [
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.moe.expert_ffn_hidden_size=768",
    "model.moe.dense_layers=1",
]
DRY_MOE = ["model.moe.expert_ffn_hidden_size=64"]
STEP_TIME_ROWS = {
    "baseline": ["model.attnres.mode=baseline"],
    "block": ["model.attnres.mode=block"],
    "full": ["model.attnres.mode=full"],
    "moe_baseline": ["model.attnres.mode=baseline", *MOE_125M],
    "moe_block": ["model.attnres.mode=block", *MOE_125M],
}


def step_time(work: Path, dry: bool) -> dict:
    """Median optimizer-step time of baseline, Block (S = 3) and Full AttnRes at one shape, and
    of the MoE model (``MOE_125M``) with the baseline residual and with Block."""
    warmup, reps = (3, 8) if on_gpu(dry) else (1, 2)
    rows = {}
    for mode, settings in STEP_TIME_ROWS.items():
        reset_peak()
        extra = [*settings, *(DRY_MOE if dry and mode.startswith("moe") else [])]
        trainer = trainer_125m(work, dry, f"step-time-{mode}", warmup + reps, *extra)
        times = step_seconds(trainer, warmup, reps)
        rows[mode] = {
            "model": trainer.builder.plan.describe(),
            "step_ms": round(1e3 * statistics.median(times), 2),
            "samples_ms": [round(1e3 * t, 2) for t in times],
            "peak_gib": peak_gib(),
        }
        del trainer
    for name, row in rows.items():  # the MoE rows against the MoE baseline
        base = rows["moe_baseline" if name.startswith("moe") else "baseline"]["step_ms"]
        row["vs_baseline"] = round(row["step_ms"] / base, 3)
    return {"shape": shape_label(dry), **rows}


def _generate_cli(export: Path, device: str) -> dict:
    cmd = [sys.executable, "-m", "attnres_dist.cli", "generate", str(export), "--device", device]
    cmd += ["--prompt", "def ", "--max-new-tokens", "48", "--temperature", "0"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"generate --device {device} failed:\n{proc.stderr[-2000:]}")
    return {"device": device, "wall_s": round(time.perf_counter() - start, 2), "text": proc.stdout}


def timed_generation(model, tokenizer, seq: int, new: int, **kwargs) -> dict:
    import torch

    from attnres_dist.export import generate as sample

    sample(model, tokenizer, "def ", 4, temperature=0.0, seq_length=seq, **kwargs)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    text = sample(model, tokenizer, "def ", new, temperature=0.0, seq_length=seq, **kwargs)
    tokens = len(tokenizer.encode(text))
    return {"tokens": tokens, "tokens_per_s": round(tokens / (time.perf_counter() - start), 1)}


def generate(work: Path, dry: bool) -> dict:
    """Export the tiny run (trained by ``train_tiny``; a short one here if it is missing), then
    time greedy generation on the device (the Hugging Face model with its KV cache, and the
    native model recomputing the window) and run the CLI on the GPU and on the CPU."""
    from attnres_dist.export import (
        export_checkpoint,
        exported_tokenizer,
        load_exported,
        load_for_generation,
    )

    run_dir = work / "tiny-local"
    if not (run_dir / "checkpoints").is_dir():
        train("configs/tiny.yaml", _tiny_overrides(work, "local", dry))
    export = export_checkpoint(run_dir, work / "export", warn=print)
    device = "cuda" if on_gpu(dry) else "cpu"
    new = 64 if device == "cuda" else 16
    hf, info = load_for_generation(export, device)
    tokenizer = exported_tokenizer(export, info)
    seq = int(info["model"]["seq_length"])
    result = {"device": device, "layer_spec": info.get("layer_spec")}
    result["kv_cache"] = timed_generation(hf, tokenizer, seq, new)
    native, _ = load_exported(export, device)
    result["recompute"] = timed_generation(native, tokenizer, seq, new)
    result["cli"] = [_generate_cli(export, device)]
    if device == "cuda":  # the CLI's model on the CPU of a process that sees the GPU
        result["cli"].append(_generate_cli(export, "cpu"))
    return result
