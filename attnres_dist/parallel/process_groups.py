"""Start torch.distributed and Megatron-Core's parallel state for one run.

gloo on CPU, NCCL on GPU, chosen automatically; always with a finite timeout. Megatron is told
the tensor-parallel size (its layers use those groups); DeepSpeed builds its own pipeline and
data groups with the same rank order (see ``dims.py``). Single-process runs go through the same
path with a world of one, so the reference and the parallel runs execute identical layer code.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from attnres_dist import megatron_compat
from attnres_dist.parallel import comm_device
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.launch_env import LaunchEnv, detect_launch_env, export_torch_env


def set_threads(world_size: int) -> None:
    """One intra-op thread per rank in multi-process runs, unless OMP_NUM_THREADS says otherwise.

    Launchers that leave OMP_NUM_THREADS unset (deepspeed) would otherwise run every rank with
    all cores: 2 ranks x 2 threads on 2 cores made steps 30x slower (DESIGN.md section 4).
    """
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    elif world_size > 1:
        torch.set_num_threads(1)


def init_distributed(
    dims: ParallelDims,
    timeout_s: int = 600,
    seed: int = 0,
    launch: LaunchEnv | None = None,
    device: str | None = None,
) -> LaunchEnv:
    """Initialise the default process group and Megatron's model-parallel groups.

    ``device``: the run's device type, ``cuda`` (NCCL, this rank's GPU) or ``cpu`` (gloo; on a
    machine with a GPU the model then stays off it); default: ``cuda`` when visible.
    """
    on_gpu = torch.cuda.is_available() if device is None else device == "cuda"
    launch = launch or detect_launch_env()
    dims.check_world_size(launch.world_size, launch.launcher)
    if launch.launcher != "single":
        # DeepSpeed reads these; a plain single process keeps its environment clean so that
        # what it starts later does not inherit a rendezvous port it still holds
        export_torch_env(launch)
    set_threads(launch.world_size)
    # the device of every tensor handed to torch.distributed, fixed once (comm_device.py)
    if on_gpu:
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        comm_device.declare(torch.device("cuda", torch.cuda.current_device()))
    else:
        megatron_compat.apply(force_cpu=True)  # also where a GPU is visible but not used
        comm_device.declare("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            init_method=launch.init_method,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            expert_model_parallel_size=dims.ep,
            distributed_timeout_minutes=max(1, timeout_s // 60),
        )
    megatron_compat.seed_model_parallel_rng(seed)
    return launch


def shutdown_distributed() -> None:
    """Tear down after every rank has arrived, so no rank closes connections a peer still uses."""
    from megatron.core import parallel_state

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def check_groups_agree(dims: ParallelDims, topology, rank: int) -> None:
    """Megatron's tensor- and data-parallel groups must match DeepSpeed's model and data axes.

    Both libraries derive their groups from the rank order independently; if they ever
    disagreed, collectives would mix shards or replicas of different stages.
    """
    from megatron.core import parallel_state

    stage, dp_rank, tp_rank = dims.coords(rank)
    for axis, group, expected in (
        (
            "model",
            parallel_state.get_tensor_model_parallel_group(),
            [dims.rank_of(stage, dp_rank, t) for t in range(dims.tp)],
        ),
        (
            "data",
            parallel_state.get_data_parallel_group(),
            [dims.rank_of(stage, d, tp_rank) for d in range(dims.dp)],
        ),
    ):
        megatron = sorted(dist.get_process_group_ranks(group))
        deepspeed = sorted(next(g for g in topology.get_axis_comm_lists(axis) if rank in g))
        if not megatron == deepspeed == expected:
            raise RuntimeError(
                f"rank {rank}: {axis}-parallel groups disagree: Megatron {megatron}, "
                f"DeepSpeed {deepspeed}, expected {expected}"
            )
    _check_expert_groups(dims, rank)


def _check_expert_groups(dims: ParallelDims, rank: int) -> None:
    """Megatron's expert groups must be the ones ``ParallelDims.expert_coords`` describes:
    the checkpoint, the gradient reduction and the norm count rely on that layout."""
    from megatron.core import parallel_state

    stage, dp_rank, tp_rank = dims.coords(rank)
    ep_rank, edp_rank = dims.expert_coords(rank)
    first = dp_rank - ep_rank  # the data-parallel rank of this rank's expert rank 0
    replicas = dims.dp // dims.ep
    for axis, group, expected in (
        (
            "expert-model",
            parallel_state.get_expert_model_parallel_group(),
            [dims.rank_of(stage, first + e, tp_rank) for e in range(dims.ep)],
        ),
        (
            "expert-data",
            parallel_state.get_expert_data_parallel_group(),
            [dims.rank_of(stage, ep_rank + d * dims.ep, tp_rank) for d in range(replicas)],
        ),
    ):
        megatron = sorted(dist.get_process_group_ranks(group))
        if megatron != expected:
            raise RuntimeError(
                f"rank {rank}: {axis}-parallel group {megatron}, expected {expected}"
            )
