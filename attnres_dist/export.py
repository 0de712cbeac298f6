"""Export a trained model to one safetensors file + ``config.json``; load it; sample text.

    attnres-dist export runs/tiny --output exported/tiny
    attnres-dist generate exported/tiny --prompt "def " --max-new-tokens 200

An export holds the model only (no optimizer state): every parameter as a full tensor under
its canonical (single-process) name, whatever pipeline/tensor layout wrote the checkpoint.
``load_exported`` builds the single-process ``AttnResGPT`` from ``config.json`` and loads the
weights with torch and Megatron-Core's layers only: no DeepSpeed, no checkpoint machinery, any
machine. ``generate`` samples from it (temperature, top-k) and decodes with the tokenizer the
model was trained with (bytes, or the ``tokenizer.json`` copied next to the weights). It
recomputes the whole window for every token (no KV cache): the models trained here are small.
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


def export_checkpoint(source: str | Path, output: str | Path, warn=print) -> Path:
    """Write ``output/model.safetensors`` and ``output/config.json`` from a checkpoint.

    ``source``: a checkpoint, a directory of checkpoints or a run directory (newest intact).
    """
    import safetensors.torch

    from attnres_dist.checkpoint import store
    from attnres_dist.checkpoint.state import read_tensors

    ckpt = store.resolve(source, warn)
    tensors = read_tensors(ckpt, "model/")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = dict(ckpt.manifest.get("tokenizer") or {"kind": "bytes", "vocab_size": 257})
    tokenizer["file"] = None
    if tokenizer.get("kind") == "hf" and tokenizer.get("path"):
        shutil.copyfile(tokenizer["path"], output / TOKENIZER)
        tokenizer["file"] = TOKENIZER
    config = {
        "format": EXPORT_FORMAT,
        "model": ckpt.config["model"],
        "vocab_size": ckpt.manifest["model"]["model.vocab_size (padded)"],
        "tokenizer": tokenizer,
        "step": ckpt.step,
        "source": str(ckpt.path),
        "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
    }
    _write_atomic(output / WEIGHTS, safetensors.torch.save(tensors, metadata={"format": "pt"}))
    _write_atomic(output / CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return output


def _write_atomic(path: Path, data: bytes) -> None:
    from attnres_dist.checkpoint.store import write_bytes

    tmp = path.with_name(f".{path.name}.tmp")
    write_bytes(tmp, data)
    os.replace(tmp, path)


def load_exported(directory: str | Path):
    """(single-process ``AttnResGPT`` in eval mode, the export's config dict)."""
    import safetensors.torch

    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed
    from attnres_dist.train.config import config_from_dict

    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise UserError(
            str(directory), f"not an export (needs {CONFIG} and {WEIGHTS}); run attnres-dist export"
        )
    info = json.loads((directory / CONFIG).read_text())
    if info.get("format") != EXPORT_FORMAT:
        raise UserError(str(directory / CONFIG), f"not an {EXPORT_FORMAT} config")
    model_cfg = config_from_dict({"model": info["model"]}).model
    init_distributed(ParallelDims(), seed=0)  # Megatron's layers ask for their (size-1) groups
    model = AttnResGPT(ModelBuilder(model_cfg, int(info["vocab_size"]), tp=1))
    state = safetensors.torch.load_file(str(directory / WEIGHTS))
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


def generate(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    seq_length: int = 128,
) -> str:
    """Sample a continuation of ``prompt``; stops early at the end-of-document token.

    The model sees at most the last ``seq_length`` tokens (its training window)."""
    import torch

    ids = tokenizer.encode(prompt) or [tokenizer.eod]  # an empty prompt starts a document
    start = len(ids)
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens = torch.tensor([ids[-seq_length:]], dtype=torch.long, device=device)
            logits = model(tokens)[-1, 0, : tokenizer.vocab_size].float()  # [s, b, v]: last
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = logits.softmax(-1).cpu()
                token = int(torch.multinomial(probs, 1, generator=generator))
            if token == tokenizer.eod:
                break
            ids.append(token)
    return tokenizer.decode(ids[start:])


# ------------------------------------------------------------------------------ commands


def _export_cmd(args) -> int:
    out = export_checkpoint(args.source, args.output, warn=lambda m: print(f"warning: {m}"))
    info = json.loads((out / CONFIG).read_text())
    print(f"exported step {info['step']} of {info['source']} to {out / WEIGHTS}")
    return 0


def _generate_cmd(args) -> int:
    if args.max_new_tokens < 0:
        raise UserError("--max-new-tokens", f"got {args.max_new_tokens}; must be >= 0")
    if args.top_k < 0:
        raise UserError("--top-k", f"got {args.top_k}; must be >= 0 (0 = no top-k)")
    model, info = load_exported(args.directory)
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
    )
    sys.stdout.write(args.prompt + text + "\n")
    return 0


def add_parsers(sub) -> None:
    export = sub.add_parser("export", help="write a checkpoint as model.safetensors + config.json")
    export.add_argument("source", help="a run directory, a directory of checkpoints or one")
    export.add_argument("--output", required=True, help="directory to write")
    export.set_defaults(func=_export_cmd)

    gen = sub.add_parser("generate", help="sample text from an exported model")
    gen.add_argument("directory", help="an export written by attnres-dist export")
    gen.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=40, help="0 = sample from all tokens")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate_cmd)
