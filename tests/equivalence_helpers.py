"""What the equivalence tests share: the tiny training case, its runs, and the comparison.

``overrides`` gives the dotted config of the case (4 layers x 32, block size 3, 3 optimizer
steps with clipping active) for a residual mode and layout; ``train_case`` runs it (one
process, or torchrun with ``nproc`` ranks) and loads what it trained (``workers/train_case.py``:
per-step losses, the final validation loss, every parameter by canonical name);
``assert_matches`` compares a run with its reference within TOL (fp32) and appends the reached
differences to ``ATTNRES_TOLERANCE_LOG`` when that is set.
"""

from __future__ import annotations

import json
import os

import torch

from tests.conftest import run_job

TOL = 1e-5  # absolute + relative, fp32
# the MoE equivalence case's layers: 4 experts, top-2, a shared expert, the first layer dense,
# load-balancing and z-losses on
MOE_LAYERS = {
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.dense_layers": 1,
    "model.moe.shared_expert_ffn_hidden_size": 32,
    "model.moe.z_loss_coeff": 1e-3,
}
# 8 micro-batches of 2 (4 per rank at dp = 2, as DualPipeV needs at pp = 2): the router's
# losses are per micro-batch, so every layout keeps the reference's micro-batches
MOE_BATCH = {"train.global_batch_size": 16}
MODES = ["baseline", "full", "block"]
REACHED = os.environ.get("ATTNRES_TOLERANCE_LOG")  # optional: append reached diffs (JSONL)


def overrides(data: str, mode: str, run_dir: str, pp=1, dp=1, tp=1, **extra) -> list[str]:
    base = {
        "data.path": data,
        "model.num_layers": 4,
        "model.hidden_size": 32,
        "model.num_attention_heads": 4,
        "model.seq_length": 16,
        "model.attnres.mode": mode,
        "model.attnres.block_size": 3,
        "train.steps": 3,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "train.progress": False,
        "optim.lr": 1e-2,
        # Adam's default eps (1e-8) turns a gradient element of ~1e-8 into a full lr-sized
        # step whose sign is the sign of summation-order noise: tensor-parallel reductions
        # reorder sums, and after 3 steps such elements differed by 2e-5 on some CPUs while
        # every loss agreed to 4e-7. A larger eps keeps the parameter check a check of the
        # gradients the layouts compute, not of the sign of round-off near zero. At 1e-6 the
        # untied pp = 3 case still reached 1.3e-5 (losses 4.8e-7) once the CPU kernels' sums
        # were folded from sixteen lanes instead of eight; at 1e-5 the same case reaches 1.3e-6.
        "optim.eps": 1e-5,
        "optim.warmup_steps": 1,
        "optim.grad_clip": 0.5,
        "parallel.pp": pp,
        "parallel.dp": dp,
        "parallel.tp": tp,
        "output.run_dir": run_dir,
        "output.tensorboard": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_case(tmp_path, name: str, args: list[str], nproc: int) -> dict:
    out = tmp_path / f"{name}.pt"
    run_job(["tests/workers/train_case.py", str(out), *args], nproc=nproc)
    return torch.load(out)


def reference_runs(data: str, tmp) -> dict:
    """The single-process run of every residual mode (one process): the grids' references."""
    runs = train_cases(tmp, {mode: overrides(data, mode, str(tmp / mode)) for mode in MODES}, 1)
    return {mode: result_of(runs, mode) for mode in MODES}


def single_process_reference(data: str, tmp_path, mode: str = "block", **extra) -> dict:
    """The single-process run of a case with settings of its own (``extra``)."""
    return train_case(tmp_path, "ref", overrides(data, mode, str(tmp_path / "r"), **extra), 1)


def max_diffs(result: dict, reference: dict) -> tuple[float, float]:
    loss_diff = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True))
    assert result["params"].keys() == reference["params"].keys()
    param_diff = max(
        (result["params"][k] - reference["params"][k]).abs().max().item()
        for k in reference["params"]
    )
    return loss_diff, param_diff


def assert_matches(result: dict, reference: dict, label: str) -> None:
    loss_diff, param_diff = max_diffs(result, reference)
    if REACHED:
        with open(REACHED, "a") as fh:
            fh.write(json.dumps({"case": label, "loss": loss_diff, "param": param_diff}) + "\n")
    torch.testing.assert_close(
        torch.tensor(result["losses"], dtype=torch.float64),
        torch.tensor(reference["losses"], dtype=torch.float64),
        atol=TOL,
        rtol=TOL,
    )
    for name, ref in reference["params"].items():
        torch.testing.assert_close(result["params"][name], ref, atol=TOL, rtol=TOL, msg=name)


# Measured 4e-4 (3 steps, lr 1e-2, tiny model): bf16 rounds activations and weights to 8
# mantissa bits (~4e-3 relative); the loss is a mean over 64 tokens, so its error stays below.
BF16_LOSS_TOL = 5e-3
# Adam moves each weight by up to lr = 1e-2 per step whatever the gradient's size, so a bf16
# rounding that flips a tiny gradient's sign moves that weight by up to 2 * lr per step.
BF16_PARAM_TOL = 3 * 2e-2


def assert_tracks_fp32(result: dict, reference: dict) -> None:
    """A bf16 run against the fp32 reference: losses within BF16_LOSS_TOL (and not equal: it
    ran in bf16), its fp32 master weights within BF16_PARAM_TOL."""
    losses = torch.tensor(result["losses"], dtype=torch.float64)
    expected = torch.tensor(reference["losses"], dtype=torch.float64)
    assert (losses - expected).abs().max() <= BF16_LOSS_TOL, (losses, expected)
    assert losses.ne(expected).any()  # it really ran in bf16
    assert result["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        got = result["params"][name]
        assert got.dtype == torch.float32, name  # the fp32 master weights
        torch.testing.assert_close(got, ref, atol=BF16_PARAM_TOL, rtol=0, msg=name)


def train_cases(
    tmp_path, cases: dict[str, list[str]], nproc: int, wire: bool = False
) -> dict[str, dict | str]:
    """Train ``cases`` (name -> overrides) one after the other in one launch of ``nproc`` ranks
    (``workers/train_cases.py``; ``wire``: each rank records its p2p payloads there too). Each
    name maps to its result, or to why it has none: its own traceback, or the case that stopped
    the launch before it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    flags = ["--wire"] if wire else []
    try:
        run_job(["tests/workers/train_cases.py", str(tmp_path), str(spec), *flags], nproc=nproc)
        stopped = ""
    except AssertionError as launch_error:
        stopped = str(launch_error)
    results: dict[str, dict | str] = {}
    failed = None
    for name in cases:
        errors = sorted(tmp_path.glob(f"{name}.error.*"))
        out = tmp_path / f"{name}.pt"
        if errors:
            failed = name
            # the rank that failed first, before the ones that lost it as a peer
            texts = sorted((e.read_text() for e in errors), key=lambda t: "closed by peer" in t)
            results[name] = "\n".join(texts)
        elif out.exists() and failed is None:
            results[name] = torch.load(out)
        else:
            where = f"at case {failed}" if failed else "before this case"
            results[name] = f"not run: the launch stopped {where}\n{stopped}"
    return results


def train_by_world(tmp_path, references: dict, by_world: dict[int, dict]) -> dict:
    """The single-process ``references`` in one launch (under ``"reference"``), then each world
    size's cases in one launch of that many ranks: every case's result by name."""
    results = {"reference": train_cases(tmp_path / "references", references, nproc=1)}
    for world, cases in sorted(by_world.items()):
        results |= train_cases(tmp_path / f"world{world}", cases, nproc=world)
    return results


def result_of(results: dict, name: str):
    """The case's result (a dict, or what ``p2p_record.recorded_cases`` pairs with it), or the
    test fails with why there is none (the string in its place)."""
    result = results[name]
    if isinstance(result, str):
        raise AssertionError(f"case {name} has no result:\n{result}")
    return result


def selected_params(request, test_name: str) -> list[dict]:
    """The parameters of each selected case of ``test_name`` in the requesting module: what a
    module's shared launch trains (a case deselected by tier, ``-k`` or a named node is not)."""
    return [
        item.callspec.params if hasattr(item, "callspec") else {}
        for item in request.session.items
        if item.module is request.module and item.originalname == test_name
    ]
