"""A run's training state <-> a checkpoint, for any (pp, dp, tp) layout on either side.

What is stored, by canonical parameter name (``pipeline/naming.py``) and as FULL tensors
(tensor-parallel shards gathered with Megatron's ``partition_dim``/``partition_stride``):
the parameter (``model/<name>``) and each AdamW state entry (``optim/exp_avg/<name>``,
``optim/exp_avg_sq/<name>``, ``optim/step/<name>``). The manifest holds the LR schedule, the
step (which is also the data position: batches are a function of the step), the config and
the model's shape; ``rng.pt`` holds every rank's RNG states.

Saving is collective and gathers nothing to one rank: on each stage, the tensor ranks of
data-parallel rank 0 all-gather their shards and tensor rank 0 writes the stage's file (experts
split over expert-parallel ranks: the first replica of each expert rank writes its experts,
named by global index, to a file of their own, so any ep reads them back); rank 0 then writes
the RNG file and the manifest and commits (``store.commit``). Loading is local:
each rank opens only the files holding its parameters and takes its shard with ``shard_of``.
DeepSpeed's own checkpoints restore optimizer state only at the same stage count (DESIGN.md
section 4); this format has no notion of stages, so any layout can resume any checkpoint.

An engine exposes ``checkpoint_params()`` -> ``[(canonical name, parameter, owned)]`` (owned:
this rank's copy is the one written; False for the tied embedding's second copy),
``optimizer``, ``scheduler`` and ``restored(step)``.
"""

from __future__ import annotations

import io
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from attnres_dist.checkpoint import faults, store
from attnres_dist.checkpoint.legacy_names import PackedIndex
from attnres_dist.checkpoint.store import Checkpoint, CheckpointError
from attnres_dist.config.block_plan import BLOCK_MODES
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.expert_params import is_expert_param
from attnres_dist.parallel.tp_shards import gather_full, is_sharded, shard_of

# ------------------------------------------------------------------------------ helpers


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _tp_group():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _layout(dims: ParallelDims) -> dict:
    """The layout a checkpoint records (ep only where it splits experts: older ones lack it)."""
    return {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp} | ({"ep": dims.ep} if dims.ep > 1 else {})


def _full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if tp > 1 and is_sharded(param):
        shape[param.partition_dim] *= tp
    return tuple(shape)


def _local(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    if tp > 1 and is_sharded(param):
        stride = getattr(param, "partition_stride", 1)
        full = shard_of(full, param.partition_dim, stride, tp_rank, tp)
    return full.contiguous()


def rng_state() -> dict:
    """This rank's RNG states: torch CPU, CUDA (when present) and Megatron's tracker."""
    from megatron.core.tensor_parallel import random as mp_random

    state = {
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in mp_random.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import random as mp_random

    torch.set_rng_state(state["torch"])
    mp_random.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def model_signature(model, padded_vocab_size: int) -> dict:
    """The config fields that make two models the same model (``model`` is a ModelConfig)."""
    sig = {
        "model.num_layers": model.num_layers,
        "model.hidden_size": model.hidden_size,
        "model.num_attention_heads": model.num_attention_heads,
        "model.num_query_groups": model.num_query_groups or model.num_attention_heads,
        "model.ffn_hidden_size": model.ffn_size,
        "model.vocab_size (padded)": padded_vocab_size,
        "model.tie_embeddings": model.tie_embeddings,
        "model.attnres.mode": model.attnres.mode,
    }
    if model.attnres.mode in BLOCK_MODES:
        sig["model.attnres.block_size"] = model.attnres.block_size
    if model.attnres.source_scaled_eps:
        sig["model.attnres.source_scaled_eps"] = True
    moe = model.moe
    if moe.enabled:
        sig |= {
            "model.moe.num_experts": moe.num_experts,
            "model.moe.top_k": moe.top_k,
            "model.moe.expert_ffn_hidden_size": model.expert_ffn_size,
            "model.moe.shared_expert_ffn_hidden_size": moe.shared_expert_ffn_hidden_size,
            "model.moe layers": [i for i in range(model.num_layers) if moe.is_moe_layer(i)],
        }
    return sig


# signature entries written only when they differ from their default (a dense model has no
# MoE entries: an MoE checkpoint resumed as dense names num_experts, and the reverse)
_SIGNATURE_DEFAULTS = {"model.attnres.source_scaled_eps": None, "model.moe.num_experts": 0}


def check_signature(ckpt: Checkpoint, signature: dict) -> None:
    """Raise when ``ckpt`` was written for another model than ``signature`` describes."""
    theirs = ckpt.manifest.get("model", {})
    keys = [*signature, *(k for k in _SIGNATURE_DEFAULTS if k in theirs and k not in signature)]
    for key in keys:
        ours = signature.get(key, _SIGNATURE_DEFAULTS.get(key))
        written = theirs.get(key, _SIGNATURE_DEFAULTS.get(key))
        if written != ours:
            raise CheckpointError(
                str(ckpt.path),
                f"written for {key}={written} but this run has {key}={ours}; use the "
                "checkpoint's model settings or set checkpoint.resume=none",
            )


# ------------------------------------------------------------------------------- saving


def _stage_tensors(engine, group, experts_only: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors of the parameters (and their optimizer state) this stage owns; with
    ``experts_only``, of its experts split over expert-parallel ranks only.

    Collective over the tensor-parallel group: every tensor rank runs the same loop. Under
    DeepSpeed's bf16 engine or ZeRO-1 (``engine.sharded_state``) the fp32 master weights and
    AdamW state are read from its flat partitions, collectively over each parameter's
    data-parallel group (a split expert's: its expert data-parallel group), so then every
    parameter is read and only the kept ones returned.
    """
    tensors = {}
    optimizer = engine.optimizer
    sharded = getattr(engine, "sharded_state", None)
    # apex's FusedAdam counts steps per group, torch's AdamW per parameter: stored per parameter
    group_step = {
        id(p): g["step"] for g in optimizer.param_groups if "step" in g for p in g["params"]
    }
    for name, param, owned in engine.checkpoint_params():
        if not owned:
            continue
        if sharded is not None:  # collective: read on every replica, kept or not
            value, state = sharded.master(param), sharded.state(param)
        if experts_only and not is_expert_param(param):  # data-parallel rank 0 writes it
            continue
        if sharded is None:
            value, state = param, dict(optimizer.state.get(param, {}))
        tensors[f"model/{name}"] = gather_full(value, param, group)
        if "step" not in state and id(param) in group_step:
            state["step"] = group_step[id(param)]
        for key in sorted(state):
            value = state[key]
            if torch.is_tensor(value):
                tensors[f"optim/{key}/{name}"] = gather_full(value, param, group)
            else:  # a plain number (older torch and apex keep "step" as one)
                tensors[f"optim/{key}/{name}"] = torch.tensor(float(value), dtype=torch.float32)
    return {k: v.cpu().contiguous() for k, v in tensors.items()}


def save_checkpoint(
    root: str | Path,
    step: int,
    engine,
    dims: ParallelDims,
    rank: int,
    body: dict,
    keep_last: int,
) -> Path:
    """Write and commit the checkpoint of ``step`` under ``root``. Collective.

    ``body`` is stored in the manifest (config, model signature, data position, ...); the
    schedule and layout are added here.
    """
    import safetensors.torch

    root = Path(root)
    stage, dp_rank, tp_rank = dims.coords(rank)
    ep_rank, edp_rank = dims.expert_coords(rank)
    if rank == 0:
        store.begin(root, step)
    _barrier()
    tmp = store.tmp_dir(root, step)
    written = None
    # data-parallel replicas hold identical state: one of them writes (reading sharded optimizer
    # state is collective over the data-parallel group, so then every replica reads); experts
    # split over ranks are written by the first replica of each expert rank
    writes = dp_rank == 0 or edp_rank == 0
    if writes or getattr(engine, "sharded_state", None) is not None:
        experts_only = writes and dp_rank != 0
        tensors = _stage_tensors(engine, _tp_group(), experts_only)
        if tp_rank == 0 and writes and (tensors or not experts_only):
            name = f"stage-{stage:03d}.safetensors"
            if dp_rank != 0:
                name = f"stage-{stage:03d}-experts-{ep_rank:03d}.safetensors"
            info = store.write_bytes(tmp / name, safetensors.torch.save(tensors))
            info["tensors"] = {key: list(t.shape) for key, t in tensors.items()}
            written = (name, info)
    faults.maybe_fail("mid-save", rank, step)
    mine = (written, rng_state())
    gathered = [None] * _world() if rank == 0 else None
    if _world() > 1:
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if rank == 0:
        files = dict(item[0] for item in gathered if item[0] is not None)
        buffer = io.BytesIO()
        torch.save({str(r): item[1] for r, item in enumerate(gathered)}, buffer)
        files["rng.pt"] = store.write_bytes(tmp / "rng.pt", buffer.getvalue())
        manifest = dict(body)
        manifest["layout"] = _layout(dims)
        manifest["scheduler"] = engine.scheduler.state_dict()
        store.commit(root, step, files, manifest)
        store.prune(root, keep_last)
    _barrier()
    return root / store.step_name(step)


# ------------------------------------------------------------------------------ loading


def read_tensors(ckpt: Checkpoint, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Every tensor whose key starts with ``prefix``, by the rest of its key (e.g. for export);
    an older checkpoint's unpacked depth-mixer parameters packed (``legacy_names``)."""
    from safetensors import safe_open

    out = {}
    for name, info in sorted(ckpt.manifest["files"].items()):
        keys = [k for k in info.get("tensors", {}) if k.startswith(prefix)]
        if not keys:
            continue
        with safe_open(str(ckpt.path / name), framework="pt") as fh:
            for key in keys:
                out[key[len(prefix) :]] = fh.get_tensor(key)
    packed = PackedIndex(prefix + name for name in out)  # an older checkpoint's mixers
    for key, parts in packed.parts.items():
        joined = packed.read(key, lambda k: out[k[len(prefix) :]])
        if joined is not None:
            for part in parts.values():
                del out[part[len(prefix) :]]
            out[key[len(prefix) :]] = joined
    return out


def load_checkpoint(ckpt: Checkpoint, engine, dims: ParallelDims, rank: int) -> str:
    """Load ``ckpt`` into this rank's part of the model, optimizer, schedule and RNG.

    Local: reads only the files that hold this rank's parameters. Returns a note on how the
    RNG states were restored.
    """
    from safetensors import safe_open

    from attnres_dist.model import spec_names

    _, _, tp_rank = dims.coords(rank)
    sharded = getattr(engine, "sharded_state", None)  # DeepSpeed's bf16 / ZeRO-1 partitions
    index = ckpt.tensor_index()
    packed = PackedIndex(index)  # an older checkpoint's unpacked depth-mixer parameters
    optim_keys: dict[str, list[str]] = {}
    for key in dict.fromkeys(packed.names(k) for k in index):
        if key.startswith("optim/"):
            _, state_key, name = key.split("/", 2)
            optim_keys.setdefault(name, []).append(state_key)
    with ExitStack() as stack:
        handles = {}

        def get(key: str) -> torch.Tensor:
            if key not in index and key.startswith("model/"):  # a TE-spec run, local names
                key = "model/" + (spec_names.local_name(key[len("model/") :]) or key)
            if key not in index and (joined := packed.read(key, get)) is not None:
                return joined
            if key not in index:
                raise CheckpointError(str(ckpt.path), f"has no tensor {key!r}; not this model's")
            file = index[key]
            if file not in handles:
                handles[file] = stack.enter_context(
                    safe_open(str(ckpt.path / file), framework="pt")
                )
            return handles[file].get_tensor(key)

        for name, param, _ in engine.checkpoint_params():
            full = get(f"model/{name}")
            expected = _full_shape(param, dims.tp)
            if tuple(full.shape) != expected:
                raise CheckpointError(
                    str(ckpt.path),
                    f"{name} has shape {list(full.shape)}, the model {list(expected)}",
                )
            master = _local(full, param, tp_rank, dims.tp)
            if sharded is None:
                with torch.no_grad():
                    param.copy_(master)
            state = {}
            for state_key in sorted(optim_keys.get(name, [])):
                value = get(f"optim/{state_key}/{name}")
                if tuple(value.shape) == expected:
                    state[state_key] = _local(value, param, tp_rank, dims.tp).to(param.device)
                else:  # AdamW's scalar step count stays on the CPU, in its own dtype
                    state[state_key] = value
            if sharded is not None:
                sharded.load(param, master.to(param.device), state)
            elif state:
                engine.optimizer.state[param] = state
    if not isinstance(engine.optimizer, torch.optim.AdamW):  # apex FusedAdam: a step per group
        for group in engine.optimizer.param_groups:
            steps = [engine.optimizer.state.get(p, {}).get("step") for p in group["params"]]
            if steps and all(torch.is_tensor(s) for s in steps):
                group["step"] = int(steps[0].item())
    scheduler = engine.scheduler
    if "scheduler" in ckpt.manifest:  # an imported model's step-0 checkpoint has none yet
        scheduler.load_state_dict(_per_group(ckpt.manifest["scheduler"], len(scheduler.base_lrs)))
        for group, lr in zip(engine.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    note = _restore_rng(ckpt, dims, rank)
    engine.restored(ckpt.step)
    return note


def _per_group(schedule: dict, groups: int) -> dict:
    """The LR schedule's state for ``groups`` parameter groups. Every group follows the one
    schedule (``optim.build_optimizer``), so a checkpoint written with another number of groups
    (split experts have groups of their own) gives each group its first group's entries."""
    out = dict(schedule)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if isinstance(out.get(key), list) and len(out[key]) != groups:
            out[key] = [out[key][0]] * groups
    return out


def _restore_rng(ckpt: Checkpoint, dims: ParallelDims, rank: int) -> str:
    """Each rank's own RNG states when the layout is unchanged; otherwise fresh seeds.

    Random streams (dropout) are per rank, so they can continue exactly only in the layout that
    wrote them; after resharding each rank is re-seeded from (seed, step) instead.
    """
    if ckpt.manifest.get("layout") == _layout(dims):
        states = torch.load(ckpt.path / "rng.pt", weights_only=True)
        set_rng_state(states[str(rank)])
        return "RNG states restored"
    from attnres_dist import megatron_compat

    seed = int(ckpt.config["train"]["seed"]) + ckpt.step
    torch.manual_seed(seed)
    megatron_compat.seed_model_parallel_rng(seed)
    return f"layout changed from {ckpt.manifest.get('layout')}: RNG re-seeded from seed + step"
