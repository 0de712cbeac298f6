"""DeepSpeed's pipeline engine around the AttnRes pipeline module.

Same contract as the single-process ``LocalEngine`` (``train_step``, ``eval_loss``, ``lr``):
DeepSpeed runs the 1F1B schedule over the stages (with ``parallel.schedule`` dualpipev |
interleaved, the virtual-stage engine of ``virtual_engine.py`` over model chunks), averages
gradients over micro-batches and data-parallel ranks, sums the tied embedding's gradients, and
steps a ``torch.optim.AdamW``.

Gradient clipping is done here rather than by DeepSpeed: the global norm must count every
parameter exactly once, i.e. on its first data-parallel replica (an expert split over
expert-parallel ranks: on its first expert data-parallel replica), tensor-parallel shards on
every tensor rank, replicated parameters (norms, depth-attention queries) on tensor rank 0
only, and the tied embedding on its first stage only. The optimizer's ``step`` clips with that
norm, summed over the world. Under DeepSpeed's bf16 engine or ZeRO-1
(``precision.py``) DeepSpeed's optimizer wrapper owns the gradients and clips them itself, with
a norm that follows the same count-once rule.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from attnres_dist.config import Config
from attnres_dist.data.device_copy import to_device
from attnres_dist.model.compiled_region import SteadyGuards
from attnres_dist.model.document_masks import loss_mask
from attnres_dist.model.gpt import ModelBuilder
from attnres_dist.model.moe import set_aux_loss_scale
from attnres_dist.optim import adam_class, build_optimizer
from attnres_dist.parallel.comm_device import comm_device
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.expert_params import global_expert_name, is_expert_param
from attnres_dist.parallel.process_groups import check_groups_agree
from attnres_dist.parallel.tp_shards import gather_full
from attnres_dist.pipeline import (
    bf16_bookkeeping,
    deferred_skip,
    expert_groups,
    precision,
    sequence_parallel,
    virtual_engine,
    virtual_setup,
    watchdog,
)
from attnres_dist.pipeline.module import AttnResPipelineModule
from attnres_dist.pipeline.naming import canonical_name
from attnres_dist.pipeline.partition import compute_parts
from attnres_dist.pipeline.single_replica import skip_single_replica_reduction


class GlobalNormClip:
    """Optimizer mixin: ``step`` first clips gradients to a global norm (module docstring)."""

    def __init__(self, groups, *, max_norm: float, norm_params, **kwargs):
        super().__init__(groups, **kwargs)
        self.max_norm = max_norm
        self.norm_params = norm_params  # this rank's share of the count-once rule
        self._grad_norm: torch.Tensor | None = None  # read as a number only when logged
        # set by attnres_dist.diagnostics on measured steps: sees the final, unclipped grads
        self.grad_probe = None

    @torch.no_grad()
    def step(self, closure=None):
        if self.grad_probe is not None:
            self.grad_probe()
        if self.max_norm > 0:
            # torch's multi-tensor kernels: one norm per device over this rank's counted grads,
            # squared and summed over the group, then one fused in-place scaling of all grads
            grads = [p.grad for p in self.norm_params if p.grad is not None]
            if grads:
                sq = torch.nn.utils.get_total_norm(grads, foreach=True).double().square()
            else:  # a rank may count nothing (e.g. only replicated params on tensor rank > 0)
                sq = torch.zeros((), dtype=torch.float64, device=comm_device())
            dist.all_reduce(sq)  # every parameter counted on exactly one rank of the world
            norm = sq.sqrt()
            self._grad_norm = norm
            params = [p for group in self.param_groups for p in group["params"]]
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm, foreach=True)
        return super().step(closure)

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global norm before clipping; reading it waits for the device."""
        return None if self._grad_norm is None else self._grad_norm.item()


class ClippedAdamW(GlobalNormClip, torch.optim.AdamW):
    """torch's AdamW with the global-norm clip."""


def clipped_optimizer_class(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The global-norm clip around the optimizer the runtime chose (torch AdamW, apex FusedAdam)."""
    if base is torch.optim.AdamW:
        return ClippedAdamW
    return type(f"Clipped{base.__name__}", (GlobalNormClip, base), {})


class PipelineEngine:
    def __init__(self, cfg: Config, builder: ModelBuilder, dims: ParallelDims, launch):
        import deepspeed
        import deepspeed.ops
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        # pipeline training needs no shared-memory comm op; building it JIT-compiles for ~2 min
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # a plain single process (bf16 engine on one rank) exports no launch variables;
        # DeepSpeed's PipelineModule reads this one
        os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        self.cfg, self.dims = cfg, dims
        self.runtime = builder.runtime
        self.guards = SteadyGuards(self.runtime.steady_guards)  # each training step's stance
        self.rank = launch.rank
        topology = PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)
        check_groups_agree(dims, topology, launch.rank)
        self.virtual = cfg.parallel.schedule != "1f1b"
        self.schedule_note = None
        if self.virtual:  # model chunks on every rank (virtual_engine.py)
            self.module, shapes, self.schedule_note = virtual_setup.build_module(
                cfg, builder, topology, dims.coords(self.rank)[0]
            )
            self.parts = list(self.module.layout.parts)
        else:
            self.parts = compute_parts(
                cfg.model, dims.pp, cfg.parallel.partition, builder.vocab_size
            )
            self.module = AttnResPipelineModule(
                builder,
                self.parts,
                topology,
                cfg.parallel.recompute,
                cfg.parallel.recompute_interval,
            )
        # the tied embedding's parameters (both stages' copies): the first stage's copy is the
        # one counted by the clip norm, the parameter count, checkpoints and full_state
        self._tied = frozenset(id(p) for p in self.module.tied_modules.parameters())
        self._stage = dims.coords(self.rank)[0]
        split_experts = expert_groups.register(self.module, dims)  # before DeepSpeed's engine
        self.optimizer, self._scheduler = self._build_optimizer()
        t = cfg.train
        ds_config = {
            "train_batch_size": t.global_batch_size,
            "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": cfg.grad_accum_steps,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            # virtual stages send whole payloads from every tensor rank (their receives are
            # allocated from the plan's full shapes), not DeepSpeed's tensor-parallel slices
            # (and under sequence parallelism each tensor rank's payload is its own split)
            "pipeline": {"use_reentrant": False}
            | (
                {"pipe_partitioned": False, "grad_partitioned": False}
                if self.virtual or cfg.parallel.sequence_parallel
                else {}
            ),
            # bf16 engine / ZeRO-1 (DeepSpeed clips), or fp32 ZeRO-0 (ClippedAdamW clips)
            **precision.ds_config_section(cfg, self.runtime),
        }
        with expert_groups.moe_engine(split_experts):
            if self.virtual:
                self.engine = virtual_engine.initialize(
                    self.module, self.optimizer, self._scheduler, ds_config
                )
                self.engine.set_payload_shapes(shapes, virtual_setup.payload_dtype(self.runtime))
            else:
                self.engine, _, _, _ = deepspeed.initialize(
                    model=self.module,
                    optimizer=self.optimizer,
                    lr_scheduler=self._scheduler,
                    config=ds_config,
                )
        if torch.device(self.engine.device) != comm_device():
            raise RuntimeError(
                f"DeepSpeed's engine runs on {self.engine.device} but the run's collectives use "
                f"{comm_device()} (parallel/comm_device.py); the accelerator was misdetected"
            )
        # checkpoints read and write DeepSpeed's flat fp32 partitions through this view
        self.sharded_state = None
        if precision.wrapped(cfg, self.runtime):
            self.sharded_state = precision.ShardedState(self.engine.optimizer, self.optimizer)
        if self.virtual:
            watchdog.install_virtual(self.engine, cfg.parallel.timeout_s)
        else:
            watchdog.install(self.engine, self.parts, cfg.model.num_layers, cfg.parallel.timeout_s)
        # dp = 1: DeepSpeed's gradient all-reduce over one rank is a no-op (single_replica.py)
        zero1_fp32 = cfg.parallel.zero_stage == 1 and not self.runtime.bf16
        skip_single_replica_reduction(self.engine, dims.dp, zero1_fp32)
        if cfg.parallel.sequence_parallel:  # replicated parameters saw 1 / tp of the positions
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
            sequence_parallel.install(self.engine, self.module, tp_group)
        # the bf16 optimizer's per-parameter loops as multi-tensor ops, and its skip of a step
        # with a non-finite norm decided on the device (bf16_bookkeeping.py, deferred_skip.py)
        self.bookkeeping = bf16_bookkeeping.install(
            self.engine.optimizer, self._scheduler, self._skipped_step
        )

    def _skipped_step(self) -> None:
        """The host learned that the last step was skipped on the device: what DeepSpeed's
        engine does for a skipped step (it saw none), done now."""
        self.engine.skipped_steps += 1
        self.engine._step_applied = False
        self.engine._global_grad_norm = float("inf")
        deferred_skip.step_back(self._scheduler)  # DeepSpeed does not advance it on a skip

    def settle(self) -> None:
        """Learn the last step's skip, if not learned yet (waits for that step's norm): before
        a read of the LR, the gradient norm or the schedule."""
        if self.bookkeeping is not None:
            self.bookkeeping.settle()

    @property
    def scheduler(self):
        """The LR schedule, settled (``settle``): what a checkpoint saves or loads."""
        self.settle()
        return self._scheduler

    def _owned(self, p: torch.nn.Parameter) -> bool:
        """False for the last stage's copy of the tied embedding (the first stage's counts; with
        virtual stages rank 0 holds chunk 0, so the same rule holds)."""
        return id(p) not in self._tied or self._stage == 0

    def _first_replica(self, p: torch.nn.Parameter) -> bool:
        """This rank holds the first data-parallel replica of ``p`` (an expert split over
        expert-parallel ranks: the first of its expert data-parallel replicas)."""
        if is_expert_param(p):
            return self.dims.expert_coords(self.rank)[1] == 0
        return self.dims.coords(self.rank)[1] == 0

    def _counted(self, p: torch.nn.Parameter) -> bool:
        """This rank's copy is the one the global norm and the parameter count include: its
        first replica, on tensor rank 0 unless it is a tensor-parallel shard, and the first
        stage's copy of the tied embedding."""
        tp_rank = self.dims.coords(self.rank)[2]
        sharded = getattr(p, "tensor_model_parallel", False)
        return self._owned(p) and self._first_replica(p) and (tp_rank == 0 or sharded)

    def _build_optimizer(self):
        norm_params = [p for _, p in self.module.named_parameters() if self._counted(p)]
        self.norm_params = norm_params
        if precision.wrapped(self.cfg, self.runtime):  # DeepSpeed's wrapper clips (precision.py)
            return build_optimizer(
                self.module, self.cfg.optim, self.cfg.train.steps, adam_class(self.runtime)
            )
        return build_optimizer(
            self.module,
            self.cfg.optim,
            self.cfg.train.steps,
            clipped_optimizer_class(adam_class(self.runtime)),
            max_norm=self.cfg.optim.grad_clip,
            norm_params=norm_params,
        )

    def _iterator(self, micro_batches):
        documents = self.module.documents
        batches = []
        for w in micro_batches:
            tokens, labels = w[:, :-1].contiguous(), w[:, 1:].contiguous()
            mask = loss_mask(tokens, documents)
            # on a GPU: queued copies from pinned memory, all before the step's first forward
            tokens, labels = to_device(tokens, self.device), to_device(labels, self.device)
            mask = None if mask is None else to_device(mask, self.device)
            batches.append((tokens, labels if mask is None else (labels, mask)))
        return iter(batches)

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One optimizer step; the mean loss as a 0-d tensor, not read here (reading it waits
        for the device: the trainer reads it on the steps it logs or saves)."""
        if self.runtime.graphed:  # a new generation of the CUDA graph trees (compile_region)
            torch.compiler.cudagraph_mark_step_begin()
        if self.cfg.model.moe.enabled:  # DeepSpeed scales the loss by 1 / micro-batches too
            set_aux_loss_scale(self.cfg.grad_accum_steps, self.device)
        with self.guards.step():
            return self.engine.train_batch(data_iter=self._iterator(micro_batches))

    def eval_loss(self, batches: list[torch.Tensor]) -> float:
        if self.runtime.graphed:
            torch.compiler.cudagraph_mark_step_begin()
        loss = self.engine.eval_batch(
            data_iter=self._iterator(batches), num_micro_batches=len(batches)
        )
        return float(loss)

    @property
    def lr(self) -> float:
        self.settle()
        return self.optimizer.param_groups[0]["lr"]

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before clipping of the last step (None without clipping)."""
        if self.sharded_state is not None:
            self.settle()
            norm = self.engine.get_global_grad_norm()
            return None if norm is None else float(norm)
        return self.optimizer.last_grad_norm

    @property
    def device(self) -> torch.device:
        """Where this rank computes (and where its collectives' tensors must live)."""
        return torch.device(self.engine.device)

    def named_parameters(self):
        return self.module.named_parameters()

    def checkpoint_params(self) -> list[tuple[str, torch.nn.Parameter, bool]]:
        """(canonical name, parameter, owned) of this stage; the tied embedding is owned by the
        first stage (the last stage's copy is identical and is loaded, not written). Experts
        split over ranks are named by their global index."""
        n = self.cfg.model.num_layers
        return [
            (self._name(name, n), p, self._owned(p)) for name, p in self.module.named_parameters()
        ]

    def _name(self, pipeline_name: str, num_layers: int) -> str:
        """The canonical name of one of this rank's parameters."""
        name = canonical_name(pipeline_name, num_layers)
        if self.dims.ep == 1:
            return name
        local = self.cfg.model.moe.num_experts // self.dims.ep
        return global_expert_name(name, self.dims.expert_coords(self.rank)[0] * local)

    def restored(self, step: int) -> None:
        """After a checkpoint load: DeepSpeed's own counters continue from ``step``."""
        self.engine.global_steps = step
        self.engine.global_samples = step * self.cfg.train.global_batch_size

    def global_num_parameters(self, local: int) -> int:
        """Parameters of the whole model, each counted once (see ``_build_optimizer``)."""
        count = torch.tensor(sum(p.numel() for p in self.norm_params), device=comm_device())
        dist.all_reduce(count)
        return int(count)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Every parameter, full (tensor-parallel gathered) and canonically named, on rank 0's CPU.

        Collective: every rank must call it. Other ranks get None.
        """
        from megatron.core import parallel_state

        tp_rank = self.dims.coords(self.rank)[2]
        tp_group = parallel_state.get_tensor_model_parallel_group()
        n = self.cfg.model.num_layers
        local = {}
        for name, param in self.module.named_parameters():
            if not self._owned(param):
                continue
            value = param
            if self.sharded_state is not None:  # the fp32 master weight (collective over dp)
                value = self.sharded_state.master(param)
            full = gather_full(value, param, group=tp_group)
            if self._first_replica(param) and tp_rank == 0:  # pickled to rank 0 (gather_object)
                local[self._name(name, n)] = full.cpu()
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if self.rank != 0:
            return None
        merged = {}
        for part in gathered:
            merged.update(part)
        return merged
