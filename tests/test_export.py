"""Export: one safetensors file + config.json that the single-process model loads without
DeepSpeed, a Hugging Face directory that transformers loads without DeepSpeed or Megatron-Core,
and ``generate`` samples text from either.

A short training run (in this process) leaves checkpoints; ``attnres-dist export RUN_DIR``
writes the newest. The file must hold exactly the trained parameters. A fresh interpreter in
which importing DeepSpeed fails loads the export into ``AttnResGPT`` and must reproduce the
trained model's logits; ``attnres-dist generate`` then decodes bytes from it. With
``--format hf``, both the export command and ``AutoModelForCausalLM`` run in interpreters where
DeepSpeed and Megatron-Core are not importable at all; the logits must equal the trained
model's and ``generate()``'s greedy tokens those of ``attnres-dist generate`` (KV cache) and of
the recompute-the-window path on ``AttnResGPT``.

pp = 2 and tp = 2 checkpoints (real torchrun runs, slow): the HF export of each equals the
native export loaded into ``AttnResGPT``.
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
from attnres_dist.config import load_config
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.trainer import Trainer
from tests.conftest import REPO, child_env
from tests.test_checkpoint import args_for, in_process, train

TOL = 1e-5
REACHED = os.environ.get("ATTNRES_TOLERANCE_LOG")  # optional: append reached diffs (JSONL)


def _record(name: str, diff: float) -> None:
    if REACHED:
        with open(REACHED, "a") as f:
            f.write(json.dumps({"test": name, "diff": diff, "tol": TOL}) + "\n")


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
    """(run dir, trained parameters, the model's logits on fixed tokens, those tokens). fp32 set
    explicitly: on a GPU ``auto`` would take bf16, whose engine is DeepSpeed's (no ``.model``),
    and the logits compared below are fp32's."""
    tmp = tmp_path_factory.mktemp("export")
    run_dir = tmp / "run"
    args = args_for(small_dataset, run_dir, **{"runtime.dtype": "fp32"})
    with in_process():
        try:
            trainer = Trainer(load_config(None, args))
            trainer.train()
            params = trainer.engine.full_state()
            tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
            model = trainer.engine.model.eval()
            with torch.no_grad():  # on the GPU where there is one
                logits = model(tokens.to(model.device)).cpu()
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
        env=child_env(),
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


def _without_megatron(*args: str) -> dict:
    """Run tests/workers/without_megatron.py; its last stdout line as JSON."""
    proc = subprocess.run(
        [sys.executable, "tests/workers/without_megatron.py", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _greedy(directory, prompt: str, new: int, *flags: str) -> None:
    """``attnres-dist generate`` with greedy decoding, in this process (prints the text)."""
    with in_process():
        args = ["generate", str(directory), "--prompt", prompt, "--temperature", "0"]
        assert main([*args, "--max-new-tokens", str(new), *flags]) == 0


def test_hf_export_loads_and_generates_without_deepspeed_or_megatron(trained, tmp_path, capsys):
    from attnres_dist.data.tokenizer import ByteTokenizer
    from attnres_dist.export import generate, load_exported

    run_dir, _, tmp = trained
    hf_dir, native = tmp_path / "hf", tmp_path / "native"
    result = _without_megatron("export", str(run_dir), str(hf_dir))
    assert result == {"code": 0, "leaked": []}
    tokens = tmp_path / "tokens.pt"
    tokens.write_bytes((tmp / "tokens.pt").read_bytes())
    prompt, new = "def ", 12  # 4 + 12 tokens: the trained 16-token window
    loaded = _without_megatron("load", str(hf_dir), str(tokens), prompt, str(new))
    assert loaded["leaked"] == [] and loaded["class"] == "AttnResForCausalLM"
    ref = torch.load(tmp / "logits.pt").transpose(0, 1)[..., :257]  # [b, s, v]
    diff = (torch.load(tmp_path / "hf_logits.pt") - ref).abs().max().item()
    _record("hf_logits[trained, no deepspeed/megatron]", diff)
    assert diff <= TOL, diff

    capsys.readouterr()
    _greedy(hf_dir, prompt, new)  # attnres-dist generate: KV cache
    cached = capsys.readouterr().out
    assert cached == prompt + loaded["greedy"] + "\n"
    _greedy(hf_dir, prompt, new, "--no-kv-cache")
    assert capsys.readouterr().out == cached
    assert main(["export", str(run_dir), "--output", str(native)]) == 0
    model, info = load_exported(native)  # AttnResGPT: the recompute path as it always was
    old = generate(model, ByteTokenizer(), prompt, new, temperature=0, seq_length=16)
    assert old == loaded["greedy"]
    capsys.readouterr()
    _greedy(native, prompt, new)  # a native export decodes through the same cached model
    assert capsys.readouterr().out == cached


@pytest.fixture(scope="module")
def parallel_runs(small_dataset, tmp_path_factory):
    """Checkpoints written by a pp = 2 run and by a tp = 2 run with grouped queries."""
    runs = {}
    for name, layout, extra in [
        ("pp2", {"pp": 2}, {}),
        ("tp2", {"tp": 2}, {"model.num_query_groups": 2, "model.tie_embeddings": False}),
    ]:
        run_dir = tmp_path_factory.mktemp(name) / "run"
        args = args_for(small_dataset, run_dir, **layout, **{"train.steps": 2, **extra})
        train(run_dir, args, nproc=2)
        runs[name] = run_dir
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "tp2"])
def test_hf_export_of_parallel_checkpoints(name, parallel_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from attnres_dist.export import load_exported

    run_dir = parallel_runs[name]
    for fmt in ("native", "hf"):
        args = ["export", str(run_dir), "--format", fmt, "--output", str(tmp_path / fmt)]
        assert main(args) == 0
    model, _ = load_exported(tmp_path / "native")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(tokens).transpose(0, 1)[..., :257]
        diff = (hf(tokens).logits - ref).abs().max().item()
    _record(f"hf_logits[{name}]", diff)
    assert diff <= TOL, diff


# TE's modules in each layer of Megatron-Core 0.16.1's TE spec
# (get_gpt_layer_with_transformer_engine_spec): each keeps FP8 metadata as ``_extra_state``
TE_MODULES = (
    "self_attention.linear_qkv",  # TELayerNormColumnParallelLinear (holds input_layernorm)
    "self_attention.core_attention",  # TEDotProductAttention
    "self_attention.linear_proj",  # TERowParallelLinear
    "mlp.linear_fc1",  # TELayerNormColumnParallelLinear (holds pre_mlp_layernorm)
    "mlp.linear_fc2",  # TERowParallelLinear
)


def te_named(params: dict, num_layers: int) -> dict:
    """``params`` as a TE-spec model names them, from Megatron's own statement of the map:
    the local spec's ``sharded_state_dict_keys_map`` (local prefix -> TE prefix)."""
    from megatron.core.models.gpt import gpt_layer_specs

    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    keys_map = spec.submodules.sharded_state_dict_keys_map
    out = {}
    for name, value in params.items():
        for local, te in keys_map.items():
            name = name.replace(f".layer.{local}", f".layer.{te}")
        out[name] = value
    for i in range(num_layers):
        for module in TE_MODULES:
            out[f"layers.{i}.layer.{module}._extra_state"] = torch.zeros(0, dtype=torch.uint8)
    return out


def test_a_transformer_engine_trained_checkpoint_exports(trained, tmp_path, capsys):
    from attnres_dist.checkpoint import store
    from attnres_dist.export import load_exported

    run_dir, params, tmp = trained
    num_layers = 1 + max(int(k.split(".")[1]) for k in params if k.startswith("layers."))
    te = te_named(params, num_layers)
    assert "layers.1.layer.self_attention.linear_qkv.layer_norm_weight" in te
    assert "layers.1.layer.mlp.linear_fc1.layer_norm_weight" in te
    assert f"layers.{num_layers - 1}.layer.self_attention.core_attention._extra_state" in te
    assert not any("layernorm" in k for k in te if k.startswith("layers."))
    # the trained run's checkpoint, rewritten with the TE names
    source = store.resolve(run_dir, print)
    body = {k: v for k, v in source.manifest.items() if k not in ("format", "step", "files")}
    body.pop("checksum", None)
    root = tmp_path / "te-checkpoints"
    stage = {f"model/{k}": v for k, v in te.items()}
    info = store.write_bytes(
        store.begin(root, source.step) / "stage-000.safetensors",
        safetensors.torch.save(stage),
    )
    info["tensors"] = {k: list(v.shape) for k, v in stage.items()}
    store.commit(root, source.step, {"stage-000.safetensors": info}, body)

    out = tmp_path / "exported"
    assert main(["export", str(root), "--output", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["layer_spec"] == {"trained": "te", "names": "local"}
    weights = safetensors.torch.load_file(out / "model.safetensors")
    assert weights.keys() == params.keys()  # extra state dropped, norms renamed
    for name, value in params.items():
        assert torch.equal(weights[name], value), name
    with in_process():
        try:
            model, _ = load_exported(out, "cpu")
            with torch.no_grad():
                logits = model(torch.load(tmp / "tokens.pt"))
        finally:
            shutdown_distributed()
    diff = (logits - torch.load(tmp / "logits.pt")).abs().max().item()
    print(f"TE-named checkpoint -> export -> logits: max |diff| = {diff:.3g}")
    assert diff <= 1e-6


def test_generate_refuses_a_missing_gpu_in_one_line(trained, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    run_dir, _, _ = trained
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), "--output", str(out)]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --device: cuda requested but no GPU is visible; use --device cpu"
    ]
    assert main(["generate", str(out), "--device", "tpu"]) == 2
    assert "got 'tpu'; use cpu or cuda" in capsys.readouterr().err


LOGITS = """
import json, sys, torch
from attnres_dist.export import load_exported
model, _ = load_exported(sys.argv[1], sys.argv[2])
device = next(model.parameters()).device
with torch.no_grad():
    logits = model(torch.load(sys.argv[3]).to(device)).cpu()
print(json.dumps({"diff": (logits - torch.load(sys.argv[4])).abs().max().item(),
                  "device": str(device), "cuda_visible": torch.cuda.is_available()}))
"""


@pytest.mark.cuda
def test_generate_on_the_gpu_matches_the_cpu(trained, tmp_path):
    """The same export on the GPU, on the CPU of a process that sees the GPU (Megatron must not
    take its buffers from CUDA there) and on a CPU-only process: the same logits (fp32)."""
    from attnres_dist.export import load_exported

    run_dir, _, tmp = trained
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), "--output", str(out)]) == 0
    tokens = torch.load(tmp / "tokens.pt")
    with in_process():
        try:
            model, _ = load_exported(out, "cuda")
            assert next(model.parameters()).device.type == "cuda"
            with torch.no_grad():
                torch.save(model(tokens.cuda()).cpu(), tmp_path / "gpu_logits.pt")
        finally:
            shutdown_distributed()
    env = child_env()
    for visible in ("0", ""):
        proc = subprocess.run(
            [sys.executable, "-c", LOGITS, str(out), "cpu", str(tmp / "tokens.pt")]
            + [str(tmp_path / "gpu_logits.pt")],
            cwd=REPO,
            env=env | ({"CUDA_VISIBLE_DEVICES": ""} if not visible else {}),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["device"] == "cpu" and result["cuda_visible"] == bool(visible)
        assert result["diff"] <= 1e-4, result
