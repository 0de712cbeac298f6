"""Instrumentation values against answers known in advance, under a pipeline too; the report.

* zero queries: every depth-attention mix is uniform (mean weight 1/n, largest 1/n, entropy
  log n) for every sublayer and the final aggregation;
* activation RMS and weights equal the ones recomputed from the definitions, for the first
  micro-batch of the step only;
* gradient norms per sublayer, layer and block equal torch's norms of the accumulated, unclipped
  gradients;
* a real 2-stage pipeline run gathers every layer, with the single-process run's values;
* ``attnres-dist report`` writes its figures and summary (the reading: ``test_study_report.py``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch._dynamo

from attnres_dist.config import OptimConfig, load_config
from attnres_dist.diagnostics.collector import FILENAME, Diagnostics
from attnres_dist.diagnostics.grads import sublayer_of
from attnres_dist.errors import ConfigError
from attnres_dist.model.sequence_context import sequence_context
from attnres_dist.ops import depth_attention_reference
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from attnres_dist.train.local_engine import LocalEngine
from attnres_dist.train.trainer import Trainer
from tests.conftest import run_job
from tests.tiny_model import (
    VOCAB,
    build_selected,
    naive_sources,
    naive_sublayer,
    randomize_mixers,
    tiny_overrides,
)
from tests.tiny_model import build as tiny_model


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_distributed(ParallelDims(), seed=0)


def build(mode="block", block_size=3, num_layers=3, seed=0, recompute="none", **extra):
    return tiny_model(
        mode, block_size, num_layers, seed, **{"parallel.recompute": recompute}, **extra
    )


def compiled_build(mode, block_size, compile="layer"):
    """The tiny model as ``runtime.compile`` (``layer`` or ``chunk``) builds it: the ops a
    region traces (SDPA, the torch two-phase depth attention, torch's RMSNorm), each layer (or
    all three in one) and the final aggregation a compiled region (TorchDynamo's graphs through
    ``aot_eager``)."""
    words = {
        "runtime.compile": compile,
        "runtime.compile_backend": "aot_eager",
        "model.attnres.impl": "twophase",
        "runtime.fused_norm": "off",
    }
    return build_selected(load_config(None, tiny_overrides(mode, block_size, 3, **words)))


def windows(count=2, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, 13), generator=g) for _ in range(count)]


def measured_step(model, tmp_path, micro_batches, grad_clip=1.0) -> dict:
    """One optimizer step with every_k=1; the diagnostics record it wrote."""
    engine = LocalEngine(model, OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=grad_clip), 10)
    diagnostics = Diagnostics(1, engine, model.plan, run_dir=tmp_path)
    with diagnostics.step(1):
        engine.train_step(micro_batches)
    diagnostics.close()
    lines = [json.loads(x) for x in (tmp_path / FILENAME).read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["measure", "timing"]
    assert all(layer.probe is None for layer in model.layers) and model.final.probe is None
    return lines[0]


def twin(model, mode, block_size=3):
    """A separate model with the same weights (Megatron modules cannot be deep-copied)."""
    other = build(mode, block_size)
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("mode, block_size", [("block", 3), ("full", 1)])
def test_zero_queries_give_uniform_weights(tmp_path, mode, block_size):
    model = build(mode, block_size)
    plan = model.plan
    record = measured_step(model, tmp_path, windows(1))
    assert [s["sublayer"] for s in record["sublayers"]] == list(range(1, plan.num_sublayers + 1))
    summaries = [(s["weights"], plan.num_sources(s["sublayer"])) for s in record["sublayers"]]
    summaries.append((record["final"]["weights"], plan.final_num_sources))
    for weights, n in summaries:
        assert weights["num_sources"] == n
        assert weights["mean"] == pytest.approx([1 / n] * n, abs=1e-6)
        assert weights["max"] == pytest.approx(1 / n, abs=1e-6)
        assert weights["entropy"] == pytest.approx(math.log(n), abs=1e-5)


def naive_trace(model, toks):
    """Per sublayer: its input x, output v, the running state after it, and its weights."""
    plan = model.plan
    v = [model.embedding(toks).sources()[0]]
    h = v[0]
    trace = []
    for layer in model.layers:
        m = layer.layer
        ctx = sequence_context(m.config, v[0], layer.rotary_base)
        for attention in (True, False):
            i = len(v)
            if plan.mode == "baseline":
                x, w = h, None
            else:
                size = plan.effective_block_size
                done = (i - 1) // size
                sources = naive_sources(v, i, size)
                mixer = layer.attn_mixer if attention else layer.mlp_mixer
                x, w = depth_attention_reference(
                    mixer.query, sources, mixer.key_norm_weight, return_weights=True
                )
            out = naive_sublayer(m, ctx, x, attention)
            v.append(out)
            h = h + out
            state = h if plan.mode == "baseline" else sum(v[1 + done * size : i + 1])
            trace.append({"x": x, "out": out, "state": state, "w": w})
    return trace


def rms(t):
    return t.detach().pow(2).mean().sqrt().item()


@pytest.mark.parametrize(
    ("mode", "compiled"),
    [("block", "off"), ("baseline", "off"), ("block", "layer"), ("block", "chunk")],
)
def test_rms_and_weights_equal_direct_computation(tmp_path, mode, compiled):
    """``compiled``: the layers (each, or all in one run) and the final aggregation as
    compiled regions (those of ``runtime.compile``, TorchDynamo's graphs through
    ``aot_eager``), compiled by an unmeasured step first; the measured micro-batch runs them
    eagerly (the probe is Python that a region does not trace) and the next micro-batch
    through the regions again."""
    torch._dynamo.reset()
    model = build(mode, 3) if compiled == "off" else compiled_build(mode, 3, compiled)
    randomize_mixers(model)
    micro = windows(2)
    with torch.no_grad():
        expected = naive_trace(twin(model, mode), micro[0][:, :-1])  # first micro-batch
        if compiled != "off":
            model.loss(micro[1])  # compiles every region
    record = measured_step(model, tmp_path, micro)
    for got, want in zip(record["sublayers"], expected, strict=True):
        assert got["in_rms"] == pytest.approx(rms(want["x"]), rel=1e-5)
        assert got["out_rms"] == pytest.approx(rms(want["out"]), rel=1e-5)
        assert got["state_rms"] == pytest.approx(rms(want["state"]), rel=1e-5)
        if mode == "baseline":
            assert "weights" not in got
            continue
        w = want["w"].reshape(want["w"].shape[0], -1)
        entropy = -(w * w.log()).sum(0).mean().item()
        assert got["weights"]["mean"] == pytest.approx(w.mean(1).tolist(), abs=1e-6)
        assert got["weights"]["max"] == pytest.approx(w.max(0).values.mean().item(), abs=1e-6)
        assert got["weights"]["entropy"] == pytest.approx(entropy, abs=1e-5)


@pytest.mark.parametrize("recompute", ["attnres", "full"])
def test_recompute_passes_are_not_measured_again(tmp_path, recompute):
    """Recompute re-runs the forward in backward: the record is the first pass's, unchanged."""
    records = []
    for mode in ("none", recompute):
        model = build("block", 3, recompute=mode)
        randomize_mixers(model)
        records.append(measured_step(model, tmp_path / mode, windows(2)))
    plain, recomputed = records
    for a, b in zip(plain["sublayers"], recomputed["sublayers"], strict=True):
        for key in ("in_rms", "out_rms", "state_rms"):
            assert a[key] == pytest.approx(b[key], rel=1e-6)
    assert recomputed["grad_norm"]["layers"] == pytest.approx(
        plain["grad_norm"]["layers"], rel=1e-5
    )


def test_gradient_norms_equal_torch_norms_before_clipping(tmp_path):
    model = build("block", 3)
    randomize_mixers(model)
    micro = windows(2)
    reference = twin(model, "block")
    for window in micro:
        (reference.loss(window) / len(micro)).backward()
    # clipping to 1e-3 scales the gradients; the record must hold the unclipped ones
    got = measured_step(model, tmp_path, micro, grad_clip=1e-3)["grad_norm"]
    plan = model.plan
    groups = {("sublayers", i): [] for i in range(plan.num_sublayers)}
    for index, layer in enumerate(reference.layers):
        parts = []  # (sublayer, gradient): the packed mixers' rows are their sublayers'
        for name, p in layer.named_parameters():
            if p.grad is None:
                continue
            if name == "mixer_weights":  # [attention's, MLP's] mixer
                parts += [(2 * index + 1, p.grad[0]), (2 * index + 2, p.grad[1])]
            else:
                parts.append((sublayer_of(index, name), p.grad))
        for sublayer, grad in parts:
            groups[("sublayers", sublayer - 1)].append(grad)
            groups.setdefault(("layers", index), []).append(grad)
            block = (sublayer - 1) // plan.effective_block_size
            groups.setdefault(("blocks", block), []).append(grad)
            groups.setdefault(("layers_total", None), []).append(grad)
    assert len(got["blocks"]) == plan.num_blocks
    for (key, index), grads in groups.items():
        want = torch.nn.utils.get_total_norm(grads).item()
        value = got[key] if index is None else got[key][index]
        assert value == pytest.approx(want, rel=1e-6), (key, index)


def test_off_by_default_and_validated(tmp_path):
    assert load_config(None, []).metrics.every_k == 0
    with pytest.raises(ConfigError, match="metrics.every_k"):
        load_config(None, ["metrics.every_k=-1"])
    model = build()
    engine = LocalEngine(model, OptimConfig(warmup_steps=0), 10)
    diagnostics = Diagnostics(0, engine, model.plan, run_dir=tmp_path)
    with diagnostics.step(1):
        assert model.layers[0].probe is None
        engine.train_step(windows(1))
    diagnostics.close()
    assert not (tmp_path / "diagnostics.jsonl").exists()


# -- real runs: a 2-stage pipeline against one process, then the report ------------------------

RUN = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=16",
    "model.attnres.mode=block",
    "model.attnres.block_size=3",  # the stage boundary (after layer 1) cuts block 2
    "train.steps=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.progress=false",
    "optim.warmup_steps=1",
    "metrics.every_k=1",
    "output.tensorboard=false",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_dataset):
    root = tmp_path_factory.mktemp("diag_runs")
    dirs = {}
    with pytest.MonkeyPatch.context() as env:
        # this module's own process group exported its rendezvous; the jobs start their own
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.delenv(var, raising=False)
        _train_runs(root, small_dataset, dirs)
    return dirs


def _train_runs(root, small_dataset, dirs):
    for pp in (1, 2):
        dirs[pp] = root / f"pp{pp}"
        args = [
            *RUN,
            f"data.path={small_dataset}",
            f"parallel.pp={pp}",
            f"output.run_dir={dirs[pp]}",
        ]
        if pp == 1:  # in this process (its process group is a world of one): no start-up cost
            Trainer(load_config(None, args)).train()
        else:
            run_job(["-m", "attnres_dist.cli", "train", *args], nproc=pp)


def measures(run_dir):
    lines = (run_dir / "diagnostics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "measure"]


@pytest.mark.slow
def test_pipeline_gathers_every_layer_with_single_process_values(runs):
    single, piped = measures(runs[1]), measures(runs[2])
    assert [r["step"] for r in piped] == [1, 2]
    for got, want in zip(piped, single, strict=True):
        assert [s["sublayer"] for s in got["sublayers"]] == list(range(1, 9))
        assert got["final"] is not None
        grads = got["grad_norm"]
        assert len(grads["layers"]) == 4 and len(grads["blocks"]) == 3
        assert all(v is not None for key in ("sublayers", "layers", "blocks") for v in grads[key])
        for a, b in zip(got["sublayers"], want["sublayers"], strict=True):
            for key in ("in_rms", "out_rms", "state_rms"):
                assert a[key] == pytest.approx(b[key], rel=1e-4)
            assert a["weights"]["mean"] == pytest.approx(b["weights"]["mean"], abs=1e-5)
        assert grads["layers"] == pytest.approx(want["grad_norm"]["layers"], rel=1e-4)
        assert grads["blocks"] == pytest.approx(want["grad_norm"]["blocks"], rel=1e-4)


@pytest.mark.slow
def test_report_writes_figures_and_summary(runs, tmp_path):
    from attnres_dist.cli import main

    out = tmp_path / "report"
    assert main(["report", str(runs[1]), str(runs[2]), "--out", str(out)]) == 0
    names = {p.name for p in out.glob("*.png")}
    assert {"losses.png", "magnitudes.png", "gradients.png", "routing.png"} <= names
    assert sum(n.startswith("depth_attention_") for n in names) == 2  # one per variant
    text = (out / "report.md").read_text()
    assert "## Depth statistics" in text and "![losses](losses.png)" in text
    assert "block S=3 (pp1)" in text and "block S=3 (pp2)" in text  # configs differ in pp
    assert main(["report", str(tmp_path / "missing")]) == 2


@pytest.mark.slow
def test_study_results_file_from_run_dirs(runs, tmp_path):
    """The study's last stage (no training): results.md with tables, reading and figures."""
    from argparse import Namespace

    from studies import study

    args = Namespace(
        results=str(tmp_path / "results.md"), config="configs/study-cpu.yaml", overrides=[], nproc=1
    )
    path = study.write_results(args, [runs[1], runs[2]], total_s=60.0)
    text = path.read_text()
    for section in ("## Setup", "## Results", "## Reading", "## Depth statistics", "## Figures"):
        assert section in text
    assert (tmp_path / "results" / "losses.png").is_file()
    assert "![losses](results/losses.png)" in text


def test_lr_sweep_picks_each_architectures_lowest_mean_loss():
    from types import SimpleNamespace

    from attnres_dist.diagnostics.runs import Variant
    from studies import lr_sweep

    def variant(mode, lr):
        config = {"model": {"attnres": {"mode": mode, "block_size": 3}}, "optim": {"lr": lr}}
        return Variant("?", [SimpleNamespace(config=config, mode=mode)])

    rows = [  # (mode, lr, mean final validation loss)
        ("baseline", 1e-3, 1.70),
        ("block", 1e-3, 1.64),
        ("baseline", 3e-3, 1.60),
        ("block", 3e-3, 1.66),
        ("full", 3e-3, None),  # no finished run: not a candidate
        ("full", 6e-3, 1.90),
    ]
    variants = [variant(mode, lr) for mode, lr, _ in rows]
    stats = [
        {"label": "?", "mode": m, "seeds": 2, "valid_mean": loss, "valid_std": 0.01}
        for m, _, loss in rows
    ]
    lr_sweep.label_with_lr(variants)
    assert [v.label for v in variants][:2] == ["baseline, lr 0.001", "block S=3, lr 0.001"]
    best = lr_sweep.best_per_architecture(variants, stats)
    assert [(b["label"], b["lr"], b["valid_mean"]) for b in best] == [
        ("baseline", 3e-3, 1.60),
        ("block S=3", 1e-3, 1.64),
        ("full", 6e-3, 1.90),
    ]
    assert best[2]["lrs_tried"] == [3e-3, 6e-3]
    table = "\n".join(lr_sweep.best_lr_table(best))
    assert "| block S=3 | 0.001 (0.001, 0.003) | 2 | 1.6400 ± 0.0100 | +0.0400 |" in table


@pytest.mark.slow
def test_study_with_a_learning_rate_sweep(tmp_path):
    """The whole driver, briefly: Block at 2 rates x 1 seed x 20 steps, then results.md."""
    from studies import study

    out = tmp_path / "study"
    args = ["--variants", "block", "--seeds", "1", "--lrs", "1e-3", "3e-3", "--out", str(out)]
    assert study.main([*args, "--results", str(out / "results.md"), *study.QUICK]) == 0
    names = sorted(p.name for p in out.iterdir() if p.is_dir() and "seed" in p.name)
    assert names == ["block-lr0.001-seed1", "block-lr0.003-seed1"]
    config = (out / "block-lr0.003-seed1" / "config.yaml").read_text()
    assert "lr: 0.003" in config and "min_lr: 0.0003" in config  # the config's ratio, 1/10
    text = (out / "results.md").read_text()
    assert "## Each variant at its best learning rate" in text
    assert "| block S=3, lr 0.001 |" in text and "lr swept over 0.001, 0.003" in text
