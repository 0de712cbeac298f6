"""Training signals: the FLOPs formula against counted FLOPs, MFU, peak memory, W&B offline, and
wandb imported only by a run that logs to it.

``FlopCounterMode`` counts matrix products (mm, bmm, baddbmm) in forward and backward; the
formula's matmul part must equal its count exactly. The depth attention is elementwise work in
the model (not counted), so its term is checked against the count of the same products written
as matmuls: per source, an ``h``-long dot product for the logit and a multiply-add per element
for the mix. On these tiny models the depth term is 1.7-2.4% of the total: the
tolerance a count of the model alone would need.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnres_dist.config import AttnResConfig, ModelConfig, MoEConfig
from attnres_dist.train.flops import depth_sources, mfu, training_flops_per_token
from attnres_dist.train.signals import StepSignals, peak_memory_bytes, resolve_peak_tflops

CASES = [  # (mode, block size, tied, query groups[, MoE])
    ("baseline", 2, True, None),
    ("block", 3, True, 2),
    ("full", 1, False, None),
    # layer 0 dense, layer 1 MoE: top-2 of 4 experts of width 40 and a shared one of 24
    ("block", 2, True, None, MoEConfig(4, 2, 40, 24, dense_layers=1)),
    # heads of 16 channels at hidden 32 (4 heads: 64 query channels), query and key norms
    ("block", 2, True, 2, None, {"head_dim": 16, "qk_norm": True}),
]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    init_distributed(ParallelDims(), seed=0)


def model_config(mode, block_size, tied, groups, moe=None, extra=None) -> ModelConfig:
    return ModelConfig(
        **(extra or {}),
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=groups,
        seq_length=16,
        tie_embeddings=tied,
        attnres=AttnResConfig(mode=mode, block_size=block_size),
        moe=moe or MoEConfig(),
    )


@pytest.mark.parametrize(
    "case", CASES, ids=["baseline", "block", "full", "block-moe", "block-head16-qk-norm"]
)
def test_matmul_flops_equal_flop_counter(case):
    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder

    cfg = model_config(*case)
    # the lean op mixes without matmuls, so the counter sees the layers' matmuls only (the
    # two-phase ops' products are depth-attention FLOPs, counted apart in the test below)
    cfg.attnres.impl = "lean"
    builder = ModelBuilder(cfg, 100, seed=0)
    model = AttnResGPT(builder)
    window = torch.randint(0, 100, (3, cfg.seq_length + 1))
    with FlopCounterMode(display=False) as counter:
        model.loss(window).backward()
    tokens = 3 * cfg.seq_length
    flops = training_flops_per_token(cfg, builder.vocab_size)
    assert counter.get_total_flops() == flops.matmul * tokens
    share = flops.depth / flops.total
    assert (share == 0) == (cfg.attnres.mode == "baseline") and share < 0.03


def matmul_depth_attention(query, sources, gain, eps=1e-6):
    """Depth attention with its two products as matmuls (``einsum`` would turn a one-source
    mix into an elementwise product, which the counter does not see)."""
    h = query.shape[0]
    values = torch.stack(sources, dim=-2).reshape(-1, len(sources), h)  # [tokens, n, h]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * gain
    alpha = torch.softmax(keys @ query[:, None], dim=1)  # [tokens, n, 1]
    return alpha.transpose(1, 2) @ values  # [tokens, 1, h]


@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: c[0])
def test_depth_flops_equal_counted_matmul_products(case):
    cfg = model_config(*case)
    plan, h, tokens = cfg.block_plan(), cfg.hidden_size, 5 * 3
    counted = 0
    sublayer_sources = [plan.num_sources(i) for i in range(1, plan.num_sublayers + 1)]
    for n in [*sublayer_sources, plan.final_num_sources]:
        sources = [torch.randn(5, 3, h, requires_grad=True) for _ in range(n)]
        query, gain = torch.randn(h, requires_grad=True), torch.ones(h, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            matmul_depth_attention(query, sources, gain).sum().backward()
        counted += counter.get_total_flops()
    assert depth_sources(plan) == sum(sublayer_sources) + plan.final_num_sources
    assert training_flops_per_token(cfg, 128).depth * tokens == counted


def test_mfu_and_peaks():
    assert mfu(6e6, 1000.0, devices=2, peak_tflops=0.003) == pytest.approx(1.0)
    assert resolve_peak_tflops(None, torch.device("cpu")) is None
    assert resolve_peak_tflops(2.5, torch.device("cpu")) == 2.5
    before = peak_memory_bytes(torch.device("cpu"))
    block = torch.ones(64, 2**20, dtype=torch.uint8)  # touch 64 MiB
    block += 1
    assert peak_memory_bytes(torch.device("cpu")) >= max(before, 64 * 2**20)
    cfg = model_config("block", 3, True, None)
    record = StepSignals(cfg, 128, 1, "cpu", peak_tflops=0.5).record(tokens=480, seconds=2.0)
    per_token = training_flops_per_token(cfg, 128).total
    assert record["tokens_per_s"] == 240.0
    assert record["mfu"] == pytest.approx(per_token * 240.0 / 0.5e12)
    assert len(record["peak_memory_mb_per_rank"]) == 1 and record["peak_memory_mb"] > 64
    assert "mfu" not in StepSignals(cfg, 128, 1, "cpu").record(tokens=480, seconds=2.0)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_run_gets_the_metrics(tmp_path, monkeypatch):
    from attnres_dist.train.metrics import MetricsWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(
        tmp_path, 3, tensorboard=False, progress=False, wandb_project="attnres", config={"a": 1}
    )
    writer.log(1, "train", loss=2.5, grad_norm=0.7, peak_memory_mb_per_rank=[1.0, 2.0])
    writer.log(2, "valid", loss=2.25)
    writer.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (record,) = runs[0].glob("*.wandb")  # the offline run, for `wandb sync`
    deadline = time.monotonic() + 300  # slow on a loaded machine; ends at the record
    while b"valid/loss" not in record.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)  # wandb's service process writes the record file after finish()
    logged = record.read_bytes()
    for key in (b"train/loss", b"train/grad_norm", b"valid/loss"):
        assert key in logged, key
    assert b"train/peak_memory_mb_per_rank" not in logged  # lists stay in the JSONL
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["peak_memory_mb_per_rank"] == [1.0, 2.0]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
@pytest.mark.parametrize("project", [None, "attnres"])
def test_megatron_imports_wandb_only_for_a_run_that_logs_to_it(project):
    """In a fresh process (this one has imported wandb): with no project, Megatron-Core's own
    import of wandb finds it absent and Megatron runs without it; with one, it is imported."""
    code = (
        "import sys\n"
        "from attnres_dist.train.metrics import skip_wandb_unless_used\n"
        f"skip_wandb_unless_used({project!r})\n"
        "from megatron.core.inference.contexts import dynamic_context\n"
        "print(dynamic_context.HAVE_WANDB, sys.modules['wandb'] is None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout.split()
    assert out == (["False", "True"] if project is None else ["True", "False"])
