"""Import a Llama-family Hugging Face model as a run at step 0, in any AttnRes mode.

    attnres-dist import-hf path/to/llama --output runs/llama-block --mode block --block-size 4
    attnres-dist train --config runs/llama-block/config.yaml parallel.pp=2

The output is a run directory: ``config.yaml`` (the model derived from the source's
``config.json``, its tokenizer, this directory as ``output.run_dir``), ``tokenizer.json`` (and
the source's other tokenizer files), and ``checkpoints/step-00000000``, a trainer checkpoint
with the model only: ``train`` resumes it at step 0 with a fresh optimizer and schedule, under
any ``pp x dp x tp`` and schedule (checkpoints hold full tensors under canonical names).

Function-preserving: the depth-attention queries are zero and their key gains one, so every
depth mix is the mean of its sources, whose sum is the source model's residual stream; the
RMSNorm after every mix removes the 1/n (Delta Full: the 1 + 1/n) up to its epsilon, which
``source_scaled_eps`` scales to make it exact (docs/checkpoints.md, "Continue pretraining a
Llama-family model with AttnRes", derives it, and the perturbation Delta Block's blocks
bring). ``baseline`` mode is the source model exactly.

Everything is checked before anything is written (``hf/llama_source.py``); the directory is
assembled beside ``--output`` and moved into place only when complete, and an existing
``--output`` is refused, never overwritten.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from attnres_dist.errors import UserError

# tokenizer files copied beside tokenizer.json when the source has them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def run_config(source, output: Path, mode: str, block_size: int, overrides=()):
    """The run's ``Config``: the source's model, the chosen AttnRes mode, its tokenizer (the
    copy in ``output``), ``output`` as the run directory (so ``resume: auto`` finds step 0)."""
    from attnres_dist.config import load_config

    fields = {f"model.{k}": v for k, v in source.model.items()}
    fields.update(
        {
            "model.attnres.mode": mode,
            "model.attnres.block_size": block_size,
            # exact at step 0: the norm after a mix of n sources takes eps / n^2 (Delta: times
            # (1 + 1/n)^2; BlockPlan.zero_query_scale)
            "model.attnres.source_scaled_eps": mode != "baseline",
            "data.tokenizer": "hf",
            "data.tokenizer_path": str(output / "tokenizer.json"),
            "output.run_dir": str(output),
            "checkpoint.resume": "auto",
        }
    )
    items = [f"{k}={'null' if v is None else v}" for k, v in fields.items()]
    return load_config(None, [*items, *overrides])


def _check_output(output: Path) -> None:
    if output.exists():
        raise UserError(
            "--output", f"{output} already exists; import-hf writes a new directory, never over one"
        )


def _model_parts(builder):
    """(canonical prefix, part) of the single-process model, built one at a time: only their
    names and shapes are needed, never the whole model at once."""
    m = builder.model
    yield "embedding", builder.embedding()
    for i in range(m.num_layers):
        yield f"layers.{i}", builder.layer(i)
    yield "final", builder.final()
    if not m.tie_embeddings:
        yield "output", builder.output()


def imported_state(source, cfg) -> tuple[dict, int]:
    """(canonical state dict of the whole model in fp32, padded vocabulary): the source's
    weights, zero depth-attention queries and unit key gains."""
    import torch

    from attnres_dist.hf.llama_source import read_weights
    from attnres_dist.hf.weights import canonical_state_dict
    from attnres_dist.model.gpt import ModelBuilder
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed
    from attnres_dist.runtime import RuntimeChoice

    m = cfg.model
    try:
        weights = canonical_state_dict(
            read_weights(source), m.num_layers, m.num_attention_heads,
            m.num_query_groups or m.num_attention_heads, m.tie_embeddings,
        )  # fmt: skip
    except KeyError as exc:
        msg = f"{exc.args[0]}; not a {source.architecture}"
        raise UserError(str(source.directory), msg) from None
    # the model's own parts name and shape every parameter the checkpoint must hold
    init_distributed(ParallelDims(), seed=0, device="cpu")
    builder = ModelBuilder(m, m.vocab_size, runtime=RuntimeChoice.plain("cpu"))
    state = {}
    for prefix, part in _model_parts(builder):
        for local, param in part.named_parameters():
            name = f"{prefix}.{local}"
            if name in weights:
                value = weights.pop(name)
                if value.shape != param.shape:
                    raise UserError(
                        str(source.directory),
                        f"{name} has shape {list(value.shape)}, config.json implies "
                        f"{list(param.shape)}",
                    )
                state[name] = value.to(torch.float32).contiguous()
            elif name.endswith(".mixer_weights"):
                # zero queries (uniform depth attention: the mean of the sources), unit gains
                uniform = torch.zeros(param.shape)  # [mixers, (query, key gain), D]
                uniform[:, 1] = 1.0
                state[name] = uniform
            else:
                raise UserError(str(source.directory), f"has no weight for {name}")
    if weights:
        raise UserError(str(source.directory), f"unexpected weight {sorted(weights)[0]}")
    return state, builder.vocab_size


def _write_checkpoint(root: Path, cfg, state: dict, padded: int, source) -> None:
    """The step-0 checkpoint under ``root``; it records the tokenizer at its final path."""
    import safetensors.torch

    from attnres_dist.checkpoint import store
    from attnres_dist.checkpoint.state import model_signature

    tmp = store.begin(root, 0)
    tensors = {f"model/{name}": value for name, value in state.items()}
    info = store.write_bytes(tmp / "stage-000.safetensors", safetensors.torch.save(tensors))
    info["tensors"] = {key: list(t.shape) for key, t in tensors.items()}
    body = {
        "config": cfg.to_dict(),
        "model": model_signature(cfg.model, padded),
        "tokenizer": {
            "kind": "hf",
            "path": str(Path(cfg.data.tokenizer_path).resolve()),
            "vocab_size": source.tokenizer_vocab,
            "eod": source.eod,
        },
        # no optimizer state, schedule or RNG states: training starts afresh at step 0
        "imported": {"from": str(source.directory.resolve()), "architecture": source.architecture},
    }
    store.commit(root, 0, {"stage-000.safetensors": info}, body)


def import_hf(
    directory: str | Path,
    output: str | Path,
    mode: str = "block",
    block_size: int = 2,
    overrides=(),
) -> Path:
    """Write the run directory ``output`` for the Llama-family model in ``directory``."""
    import yaml

    from attnres_dist.hf.llama_source import read_source

    output = Path(output)
    _check_output(output)
    source = read_source(directory)
    cfg = run_config(source, output, mode, block_size, overrides)
    tmp = output.with_name(f".{output.name}.import-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name in TOKENIZER_FILES:
            if (source.directory / name).is_file():
                shutil.copyfile(source.directory / name, tmp / name)
        state, padded = imported_state(source, cfg)
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        _write_checkpoint(tmp / "checkpoints", cfg, state, padded, source)
        _check_output(output)
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


# ------------------------------------------------------------------------------ command


def _import_cmd(args) -> int:
    out = import_hf(args.directory, args.output, args.mode, args.block_size, args.overrides)
    print(f"imported {args.directory} to {out} (step 0); train it with:")
    print(f"  attnres-dist train --config {out / 'config.yaml'}")
    return 0


def add_parser(sub) -> None:
    cmd = sub.add_parser(
        "import-hf", help="a Llama-family Hugging Face model as a run at step 0 (any AttnRes mode)"
    )
    cmd.add_argument("directory", help="a Hugging Face model directory (config.json, weights, "
                     "tokenizer.json)")  # fmt: skip
    cmd.add_argument("--output", required=True, help="run directory to create (must not exist)")
    cmd.add_argument(
        "--mode",
        default="block",
        help="baseline | block | full | delta_full | delta_block (default block; delta_block "
        "is not exact at step 0: docs/checkpoints.md)",
    )
    cmd.add_argument(
        "--block-size", type=int, default=2, help="sublayers per block (block, delta_block)"
    )
    cmd.add_argument(
        "overrides", nargs="*", help="dotted config overrides, e.g. model.seq_length=1024"
    )
    cmd.set_defaults(func=_import_cmd)
