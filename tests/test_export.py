"""Export: one safetensors file + config.json that the single-process model loads without
DeepSpeed, and ``generate`` samples text from it.

A short training run (in this process) leaves checkpoints; ``attnres-dist export RUN_DIR``
writes the newest. The file must hold exactly the trained parameters. A fresh interpreter in
which importing DeepSpeed fails loads the export into ``AttnResGPT`` and must reproduce the
trained model's logits; ``attnres-dist generate`` then decodes bytes from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from attnres_dist.cli import main
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.config import load_config
from attnres_dist.train.trainer import Trainer
from tests.conftest import LAUNCH_VARS, REPO
from tests.test_checkpoint import args_for, in_process

NO_DEEPSPEED = """
import json, sys
sys.modules["deepspeed"] = None  # any import of DeepSpeed now raises ImportError
import torch
torch.set_num_threads(1)
from attnres_dist.export import exported_tokenizer, generate, load_exported
model, info = load_exported(sys.argv[1])
tokens = torch.load(sys.argv[2])
with torch.no_grad():
    diff = (model(tokens) - torch.load(sys.argv[3])).abs().max().item()
tok = exported_tokenizer(sys.argv[1], info)
text = generate(model, tok, "def ", 30, temperature=0.0, seq_length=info["model"]["seq_length"])
print(json.dumps({"diff": diff, "greedy": text, "deepspeed": "deepspeed" in sys.modules and
                  sys.modules["deepspeed"] is not None}))
"""


@pytest.fixture(scope="module")
def trained(small_dataset, tmp_path_factory):
    """(run dir, trained parameters, the model's logits on fixed tokens, those tokens)."""
    tmp = tmp_path_factory.mktemp("export")
    run_dir = tmp / "run"
    with in_process():
        try:
            trainer = Trainer(load_config(None, args_for(small_dataset, run_dir)))
            trainer.train()
            params = trainer.engine.full_state()
            tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                logits = trainer.engine.model.eval()(tokens)
        finally:
            shutdown_distributed()
    torch.save(tokens, tmp / "tokens.pt")
    torch.save(logits, tmp / "logits.pt")
    return run_dir, params, tmp


def test_export_holds_exactly_the_trained_parameters(trained, tmp_path):
    run_dir, params, _ = trained
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    weights = safetensors.torch.load_file(out / "model.safetensors")
    assert weights.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(weights[name], value), name
    config = json.loads((out / "config.json").read_text())
    assert config["step"] == 5 and config["tokenizer"]["kind"] == "bytes"


def test_export_loads_and_generates_without_deepspeed(trained, tmp_path, capsys):
    run_dir, _, tmp = trained
    out = tmp_path / "exported"
    assert main(["export", str(run_dir / "checkpoints"), "--output", str(out)]) == 0
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            NO_DEEPSPEED,
            str(out),
            str(tmp / "tokens.pt"),
            str(tmp / "logits.pt"),
        ],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k not in LAUNCH_VARS},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["diff"] <= 1e-6 and not result["deepspeed"]
    assert isinstance(result["greedy"], str)
    capsys.readouterr()  # drop export's own output
    args = ["generate", str(out), "--prompt", "def ", "--max-new-tokens", "40", "--seed", "1"]
    with in_process():
        assert main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > len("def ")


def test_export_of_a_missing_run_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {tmp_path / 'nope'}: not found; give a checkpoint, a directory of checkpoints "
        "or a run directory"
    ]
