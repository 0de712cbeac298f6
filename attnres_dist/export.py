"""Export a trained model; load it; sample text.

    attnres-dist export runs/tiny --output exported/tiny                 (--format native)
    attnres-dist export runs/tiny --format hf --output exported/tiny-hf  (Hugging Face)
    attnres-dist generate exported/tiny --prompt "def " --max-new-tokens 200

An export holds the model only (no optimizer state), whatever pipeline/tensor layout wrote the
checkpoint. ``native`` (the default): every parameter as a full tensor under its canonical
(single-process) name plus this project's ``config.json``; ``load_exported`` builds the
single-process ``AttnResGPT`` from it with torch and Megatron-Core's layers only (no
DeepSpeed). ``hf``: a transformers directory (``attnres_dist/hf/writer.py``) that
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads.

Parameter names are always the local layer spec's: a Transformer-Engine-trained checkpoint's
fused norm gains are renamed (``model/spec_names.py``, TE's ``_extra_state`` dropped) and the
native ``config.json`` records the spec the model was trained with (``layer_spec``).

``generate`` reads either format into the Hugging Face model (``load_for_generation``; no
Megatron-Core, no DeepSpeed) and samples with a KV cache (``attnres_dist/generation.py``:
temperature, top-k, the training tokenizer); ``--no-kv-cache`` recomputes the whole window
for every token instead, the reference the cache is tested against. ``--device`` (``cuda`` or
``cpu``; default the GPU when there is one) places the model; ``load_exported`` builds the
single-process ``AttnResGPT`` with the plain runtime of that device (local spec, torch ops,
fp32), so a CPU model in a process that sees a GPU keeps Megatron off the GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from attnres_dist.errors import UserError

EXPORT_FORMAT = "attnres-dist-export/1"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
FORMATS = ("native", "hf")


def _check_target(fmt: str, output: str | Path) -> None:
    if fmt not in FORMATS:
        raise UserError("--format", f"got {fmt!r}; allowed: {', '.join(FORMATS)}")
    if Path(output).exists() and not Path(output).is_dir():
        raise UserError("--output", f"{output} is a file; give a directory to write the export to")


def _checkpoint_tokenizer(ckpt) -> dict:
    """The checkpoint's tokenizer record; a Hugging Face tokenizer file must still exist."""
    tokenizer = dict(ckpt.manifest.get("tokenizer") or {"kind": "bytes", "vocab_size": 257})
    path = tokenizer.get("path")
    if tokenizer.get("kind") == "hf" and not (path and Path(path).is_file()):
        raise UserError(
            str(ckpt.path),
            f"its tokenizer file {path} (data.tokenizer_path of the run) is gone; "
            "put it back to export the model with its tokenizer",
        )
    return tokenizer


def export_checkpoint(
    source: str | Path, output: str | Path, warn=print, fmt: str = "native"
) -> Path:
    """Write the export of a checkpoint into ``output`` in format ``fmt`` (``FORMATS``).

    ``source``: a checkpoint, a directory of checkpoints or a run directory (newest intact).
    """
    import safetensors.torch

    from attnres_dist.checkpoint import store
    from attnres_dist.checkpoint.state import read_tensors
    from attnres_dist.model import spec_names

    _check_target(fmt, output)
    ckpt = store.resolve(source, warn)
    moe = ckpt.config["model"].get("moe", {})
    if moe.get("num_experts") and moe.get("capacity_factor") is not None:
        raise UserError(
            str(ckpt.path),
            f"an MoE model trained with model.moe.capacity_factor={moe['capacity_factor']}: "
            "the exported modeling code routes dropless, so it would not compute this model; "
            "train with capacity_factor=null to export",
        )
    tokenizer = _checkpoint_tokenizer(ckpt)
    trained = read_tensors(ckpt, "model/")
    tensors = spec_names.to_local_names(trained)
    output = Path(output)
    if fmt == "hf":
        return _export_hf(ckpt, tensors, tokenizer, output)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer["file"] = None
    if tokenizer.get("kind") == "hf" and tokenizer.get("path"):
        shutil.copyfile(tokenizer["path"], output / TOKENIZER)
        tokenizer["file"] = TOKENIZER
    config = {
        "format": EXPORT_FORMAT,
        "model": ckpt.config["model"],
        "vocab_size": ckpt.manifest["model"]["model.vocab_size (padded)"],
        # the spec that trained the model; the weights are named for the local one
        "layer_spec": {"trained": spec_names.spec_of(trained), "names": "local"},
        "tokenizer": tokenizer,
        "step": ckpt.step,
        "source": str(ckpt.path),
        "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
    }
    _write_atomic(output / WEIGHTS, safetensors.torch.save(tensors, metadata={"format": "pt"}))
    _write_atomic(output / CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return output


def _export_hf(ckpt, tensors: dict, tokenizer: dict, output: Path) -> Path:
    from attnres_dist.config import config_from_dict
    from attnres_dist.hf.writer import write_hf_export

    model = config_from_dict({"model": ckpt.config["model"]}).model
    extra = {
        "model": ckpt.config["model"],
        "tokenizer": {k: tokenizer.get(k) for k in ("kind", "vocab_size", "eod")},
        "step": ckpt.step,
        "source": str(ckpt.path),
    }
    padded = int(ckpt.manifest["model"]["model.vocab_size (padded)"])
    return write_hf_export(output, tensors, model, padded, tokenizer, extra)


def _write_atomic(path: Path, data: bytes) -> None:
    from attnres_dist.checkpoint.store import write_bytes

    tmp = path.with_name(f".{path.name}.tmp")
    write_bytes(tmp, data)
    os.replace(tmp, path)


def _read_config(directory: Path) -> dict:
    """``config.json`` of an export of either format (one-line error for anything else)."""
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise UserError(
            str(directory), f"not an export (needs {CONFIG} and {WEIGHTS}); run attnres-dist export"
        )
    info = json.loads((directory / CONFIG).read_text())
    if info.get("format") != EXPORT_FORMAT and info.get("model_type") != "attnres":
        raise UserError(
            str(directory / CONFIG), f"neither an {EXPORT_FORMAT} nor an attnres (hf) config"
        )
    return info


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(device: str | None) -> str:
    """The requested device (default ``default_device()``), refused in one line if unusable."""
    import torch

    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise UserError("--device", f"got {device!r}; use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device", "cuda requested but no GPU is visible; use --device cpu")
    return device


def load_exported(directory: str | Path, device: str | None = None):
    """(single-process ``AttnResGPT`` in eval mode on ``device``, the export's config dict).

    ``device``: ``cuda`` or ``cpu`` (default: ``default_device()``). A CPU model in a process
    that sees a GPU keeps Megatron off the GPU for the rest of the process.
    """
    import safetensors.torch

    from attnres_dist.config import config_from_dict
    from attnres_dist.model import spec_names
    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed
    from attnres_dist.runtime import RuntimeChoice

    device = _device(device)
    directory = Path(directory)
    info = _read_config(directory)
    if info.get("format") != EXPORT_FORMAT:
        raise UserError(str(directory / CONFIG), f"not an {EXPORT_FORMAT} config")
    model_cfg = config_from_dict({"model": info["model"]}).model
    # Megatron's layers ask for their (size-1) groups
    init_distributed(ParallelDims(), seed=0, device=device)
    runtime = RuntimeChoice.plain(device)
    model = AttnResGPT(ModelBuilder(model_cfg, int(info["vocab_size"]), tp=1, runtime=runtime))
    # exports name weights for the local spec; an older one of a TE-trained model may not
    state = spec_names.to_local_names(safetensors.torch.load_file(str(directory / WEIGHTS)))
    names = {name for name, _ in model.named_parameters()}
    if set(state) != names:
        raise UserError(
            str(directory / WEIGHTS),
            f"parameters do not match the model in {CONFIG}: missing "
            f"{sorted(names - set(state))[:3]}, unexpected {sorted(set(state) - names)[:3]}",
        )
    model.load_state_dict(state, strict=False)  # buffers (none persistent today) keep init values
    return model.eval(), info


def exported_tokenizer(directory: str | Path, info: dict):
    from attnres_dist.data.tokenizer import build_tokenizer

    tok = info.get("tokenizer") or {}
    if tok.get("kind") == "hf":
        return build_tokenizer("hf", str(Path(directory) / (tok.get("file") or TOKENIZER)))
    return build_tokenizer("bytes")


def load_for_generation(directory: str | Path, device: str | None = None):
    """(the Hugging Face ``AttnResForCausalLM`` in eval mode on ``device``, the export's info
    dict with ``model`` and ``tokenizer``) for an export of either format; torch + transformers
    only. ``device``: ``cuda`` or ``cpu`` (default: the GPU when there is one)."""
    import safetensors.torch

    from attnres_dist.config import config_from_dict
    from attnres_dist.hf import writer
    from attnres_dist.hf.modeling_attnres import AttnResForCausalLM
    from attnres_dist.model import spec_names

    device = _device(device)
    directory = Path(directory)
    info = _read_config(directory)
    if info.get("model_type") == "attnres":
        writer.quiet_transformers()
        model = AttnResForCausalLM.from_pretrained(directory).eval()
        return model.to(device), info["attnres_dist"]
    tokenizer = exported_tokenizer(directory, info)
    # exports name weights for the local spec; an older one of a TE-trained model may not
    tensors = spec_names.to_local_names(safetensors.torch.load_file(str(directory / WEIGHTS)))
    model_cfg = config_from_dict({"model": info["model"]}).model
    vocab = int(info["tokenizer"].get("vocab_size") or tokenizer.vocab_size)
    config = writer.hf_config(model_cfg, vocab, int(info["vocab_size"]), tokenizer.eod, info)
    try:
        model = writer.hf_model(tensors, config)
    except KeyError as exc:
        raise UserError(str(directory / WEIGHTS), f"{exc.args[0]} in {CONFIG}") from None
    return model.to(device), info


def generate(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    seq_length: int = 128,
    kv_cache: bool = True,
) -> str:
    """Sample a continuation of ``prompt``; stops early at the end-of-document token.

    ``model``: the Hugging Face model (``load_for_generation``), decoded with a KV cache unless
    ``kv_cache`` is False, or an ``AttnResGPT`` (``load_exported``), which recomputes the
    window for every token. Either sees at most ``seq_length`` tokens (``generation.py``)."""
    from attnres_dist import generation

    ids = tokenizer.encode(prompt) or [tokenizer.eod]  # an empty prompt starts a document
    device = next(model.parameters()).device
    if getattr(getattr(model, "config", None), "model_type", None) != "attnres":
        next_logits = generation.RecomputeWindow(
            generation.native_forward(model), seq_length, device
        )
    elif kv_cache:
        next_logits = generation.CachedDecoder(model, seq_length)
    else:
        next_logits = generation.RecomputeWindow(generation.hf_forward(model), seq_length, device)
    new = generation.sample(
        next_logits,
        ids,
        tokenizer.vocab_size,
        tokenizer.eod,
        max_new_tokens,
        temperature,
        top_k,
        seed,
    )
    return tokenizer.decode(new)


# ------------------------------------------------------------------------------ commands


def _export_cmd(args) -> int:
    warn = lambda m: print(f"warning: {m}")
    out = export_checkpoint(args.source, args.output, warn=warn, fmt=args.format)
    info = json.loads((out / CONFIG).read_text())
    info = info.get("attnres_dist", info)
    print(f"exported step {info['step']} of {info['source']} to {out} ({args.format})")
    return 0


def _generate_cmd(args) -> int:
    if args.max_new_tokens < 0:
        raise UserError("--max-new-tokens", f"got {args.max_new_tokens}; must be >= 0")
    if args.top_k < 0:
        raise UserError("--top-k", f"got {args.top_k}; must be >= 0 (0 = no top-k)")
    model, info = load_for_generation(args.directory, args.device)
    tokenizer = exported_tokenizer(args.directory, info)
    text = generate(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        seq_length=int(info["model"]["seq_length"]),
        kv_cache=not args.no_kv_cache,
    )
    sys.stdout.write(args.prompt + text + "\n")
    return 0


def add_parsers(sub) -> None:
    export = sub.add_parser("export", help="write a checkpoint as a model directory")
    export.add_argument("source", help="a run directory, a directory of checkpoints or one")
    export.add_argument("--output", required=True, help="directory to write")
    export.add_argument(
        "--format",
        default="native",
        help="native (default: this project's safetensors + config.json) or hf (a Hugging "
        "Face transformers directory: AutoModelForCausalLM with trust_remote_code)",
    )
    export.set_defaults(func=_export_cmd)

    gen = sub.add_parser("generate", help="sample text from an exported model")
    gen.add_argument("directory", help="an export written by attnres-dist export (any format)")
    gen.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=40, help="0 = sample from all tokens")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute the whole window for every token (the slow reference)",
    )
    gen.add_argument(
        "--device", default=None, help="cuda or cpu (default: the GPU when there is one)"
    )
    gen.set_defaults(func=_generate_cmd)
