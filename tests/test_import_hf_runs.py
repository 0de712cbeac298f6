"""An imported Llama trains, reshards, resumes and exports; bad sources are refused in one line.

The source is a small transformers ``LlamaForCausalLM`` (``test_import_hf.make_llama``). The
first training loss of the imported Block model (the trainer's own run, its CPU fast paths
included) equals transformers' loss on the same batch within 1e-4. Then the
run continues at ``pp = 2`` and resumes at ``tp = 2``; an imported baseline model exported
with ``export --format hf`` gives the source's logits; the trained Block model exports and
loads in transformers with a tokenizer that declares its end-of-text and padding tokens.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnres_dist.cli import main
from attnres_dist.config import load_config
from attnres_dist.data import prepare_dataset
from attnres_dist.data.tokenizer import HFTokenizer
from attnres_dist.import_hf import import_hf
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from tests.conftest import run_job
from tests.test_import_hf import VOCAB, make_llama

TOL = 1e-4
RUN = (
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_batches=1",
    "train.eval_every=100",
    "train.log_every=1",
    "train.progress=false",
    "output.tensorboard=false",
    "optim.warmup_steps=1",
)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_distributed(ParallelDims(), seed=0)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama") / "src"
    make_llama(directory, layers=3, groups=2, tied=False)
    return directory


@pytest.fixture(scope="module")
def dataset(source, tmp_path_factory) -> str:
    """~40 standard-library modules in the source model's own tokenizer."""
    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    out = tmp_path_factory.mktemp("data") / "llama-tok"
    tokenizer = HFTokenizer(str(source / "tokenizer.json"))
    return prepare_dataset(files, str(out), tokenizer, valid_fraction=0.1)


def train(run: Path, *overrides: str, nproc: int = 1, run_dir: Path | None = None):
    """The train records of ``train --config run/config.yaml`` (in ``run_dir``, default run)."""
    args = ["-m", "attnres_dist.cli", "train", "--config", str(run / "config.yaml")]
    if run_dir is not None:
        overrides = (*overrides, f"output.run_dir={run_dir}")
    run_job([*args, *RUN, *overrides], nproc=nproc)
    lines = ((run_dir or run) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def source_loss(model, window: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(window[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1)).item()


def test_first_loss_then_pipeline_then_tensor_parallel_resume(source, dataset, tmp_path):
    from attnres_dist.train.trainer import resolve_dataset

    run = import_hf(source, tmp_path / "run", mode="block", block_size=4)
    resume = f"checkpoint.resume={run / 'checkpoints'}"  # another run dir starts from it too
    single = train(run, f"data.path={dataset}", "train.steps=1", resume, run_dir=tmp_path / "one")
    first = single[0]["loss"]
    cfg = load_config(str(run / "config.yaml"), [f"data.path={dataset}", "train.steps=1", *RUN])
    window = resolve_dataset(cfg)[0].global_batch(0, 4)
    source_model = make_llama(tmp_path / "plain", layers=3, groups=2, tied=False)
    expected = source_loss(source_model, window)
    print(f"first loss {first:.7f}, source model's {expected:.7f}")
    assert abs(first - expected) <= TOL

    # the import's own run directory at pp = 2: the same first loss, then a resume at tp = 2
    piped = train(run, f"data.path={dataset}", "train.steps=2", "parallel.pp=2", nproc=2)
    assert [r["step"] for r in piped] == [1, 2]
    assert abs(piped[0]["loss"] - first) <= 1e-5
    resumed = train(
        run, f"data.path={dataset}", "train.steps=3", "parallel.pp=1", "parallel.tp=2", nproc=2
    )
    assert [r["step"] for r in resumed][-1] == 3 and 3 not in [r["step"] for r in piped]

    # the trained Block model exports and loads in transformers like any run
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from attnres_dist.export import export_checkpoint

    out = export_checkpoint(run, tmp_path / "hf", fmt="hf")
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == tok.eos_token
    assert model.generation_config.eos_token_id == tok.eos_token_id == 0
    batch = tok(["def f(x):", "import"], return_tensors="pt", padding=True)
    assert batch["attention_mask"].sum().item() < batch["attention_mask"].numel()  # padded
    generate = pipeline("text-generation", model=model, tokenizer=tok)
    text = generate("def ", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("def ")


def test_imported_baseline_exports_the_source_logits(source, tmp_path):
    from transformers import AutoModelForCausalLM

    from attnres_dist.export import export_checkpoint

    run = import_hf(source, tmp_path / "run", mode="baseline")
    out = export_checkpoint(run, tmp_path / "hf", fmt="hf")
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    plain = make_llama(tmp_path / "plain", layers=3, groups=2, tied=False)
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (exported(tokens).logits - plain(tokens).logits[..., :VOCAB]).abs().max().item()
    assert diff <= TOL, diff


# --------------------------------------------------------------------------- bad inputs


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


BAD = {
    "no config.json": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: missing"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    "gpt2": (lambda d: _edit_config(d, model_type="gpt2"), "model_type: got 'gpt2'"),
    "biases": (lambda d: _edit_config(d, attention_bias=True), "attention_bias: biases"),
    "sliding window": (
        lambda d: _edit_config(d, model_type="mistral", sliding_window=16),
        "sliding_window",
    ),
    "yarn": (
        lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
        "rope_type 'yarn' is not supported",
    ),
    "vocab": (lambda d: _edit_config(d, vocab_size=256), "has 300 tokens but config.json"),
    "weights of another shape": (
        lambda d: _edit_config(d, intermediate_size=96),
        "linear_fc1.weight has shape",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_source_is_one_line_and_writes_nothing(case, source, tmp_path, capsys):
    broken = tmp_path / "src"
    shutil.copytree(source, broken)
    breaks, expected = BAD[case]
    breaks(broken)
    code = main(["import-hf", str(broken), "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing half-written


def test_existing_output_is_refused_and_left_alone(source, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["import-hf", str(source), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"
