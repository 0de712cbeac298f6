"""DeepSpeed's bf16 optimizer bookkeeping as multi-tensor ops, on this engine's instance.

Every step, DeepSpeed's ``BF16_Optimizer`` walks every parameter in Python three times, with
an aten call or more per parameter each time: it adds each bf16 gradient into its fp32
accumulator (``update_hp_grads``), lists the gradients its norm counts and takes one norm per
gradient (``get_grads_for_norm``, ``get_global_norm_of_tensors``), then scales each gradient
(``clip_tensors_by_global_norm``), after comparing the clip factor with 1 on the host. Where
the GPU step is bound by the host, that is host time per parameter (about 0.07 ms each on the
CPU proxy, ``bench/host_bench.py``), and the comparison makes the host wait for the device.

``install`` replaces three methods on the engine's optimizer instance (DeepSpeed itself is
not patched) by ones doing the same arithmetic with torch's multi-tensor ops:

* ``update_hp_grads``: one ``torch._foreach_add_`` of the bf16 gradients into fp32 views of the
  accumulators shaped like the parameters (made once), bitwise the same sums; the first
  after a clear copies them instead (``torch._foreach_copy_``: ``0 + g`` is ``g``);
* ``clear_hp_grads``: DeepSpeed zeroes the fp32 accumulators after every step, and again in
  ``zero_grad`` right after; here a clear only marks them stale, and the next
  ``update_hp_grads`` overwrites them (and zeroes those of parameters that got no gradient),
  or ``step`` zeroes them if none came. On the CPU proxy the copy took 0.37x the add's time,
  and the two zeroings of the flat buffers are gone (at 125M on a GPU, about 1.5 GB a step
  less to move);
* ``step``: the norm over the gradients DeepSpeed's rule counts (tied copies marked
  ``ds_pipe_replicated`` skipped, replicated parameters on tensor rank 0 only): which ones is
  fixed by the model, so the list is made once. A parameter that got no gradient this step
  is counted with its accumulator, which is zero, where DeepSpeed leaves it out: the same
  sum. ``torch._foreach_norm``, then DeepSpeed's sum of squares over the model-parallel group
  (skipped where that group is one rank: a sum over one rank changes nothing).
  The clip factor ``min(1, clip / (norm + 1e-6))`` multiplies the flat fp32 gradient buffers in one
  ``torch._foreach_mul_`` without being read (a factor of exactly 1 changes no bit, so this is
  DeepSpeed's clip). The rest of the step is DeepSpeed's, in its order.

A step whose norm is not finite is skipped, as DeepSpeed skips it. Where the inner optimizer
is torch's fused AdamW and the schedule a ``LambdaLR`` (this trainer's), the device decides and
the host learns a step later (``deferred_skip.py``), so the step reads nothing on the host;
elsewhere the norm is read on the host, as DeepSpeed does (on a GPU, one wait per step).

Not installed (DeepSpeed's own methods stay) with MoE layers, Muon, a gradient accumulation
dtype other than fp32, or ``immediate_grad_update``, none of which this trainer configures.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attnres_dist.pipeline.deferred_skip import DeferredSkip, deferrable

CLIP_EPS = 1e-6  # DeepSpeed's clip_tensors_by_global_norm


def installable(optimizer) -> bool:
    """Whether ``optimizer`` is a DeepSpeed ``BF16_Optimizer`` configured as this trainer does."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return (
        isinstance(optimizer, BF16_Optimizer)
        and not optimizer.has_moe_layers
        and not optimizer._uses_muon
        and not optimizer.immediate_grad_update
        and optimizer.grad_acc_dtype is torch.float32
        and float(optimizer.norm_type) == 2.0
    )


def install(optimizer, scheduler=None, on_skipped=None) -> Bookkeeping | None:
    """Replace ``update_hp_grads`` and ``step`` of ``optimizer`` (a DeepSpeed
    ``BF16_Optimizer``) by the multi-tensor ones; None (nothing replaced) where
    :func:`installable` says no. With ``scheduler`` (the engine's) and ``on_skipped`` (called
    once the host learns a step was skipped), the skip is decided on the device where
    ``deferred_skip.deferrable`` says so."""
    if not installable(optimizer):
        return None
    return Bookkeeping(optimizer, scheduler, on_skipped)


class Bookkeeping:
    """The replaced methods and the lists they walk, bound to one optimizer."""

    def __init__(self, opt, scheduler=None, on_skipped=None):
        self.opt = opt
        self.deferred = None
        if on_skipped is not None and deferrable(opt.optimizer, scheduler):
            self.deferred = DeferredSkip(opt.fp32_groups_gradients_flat[0].device)
        self.on_skipped = on_skipped
        # fp32 accumulator views shaped like the parameters, pairwise with opt.bf16_groups
        self.accumulators = [
            [hp.view(lp.shape) for lp, hp in zip(lps, hps, strict=True)]
            for lps, hps in zip(opt.bf16_groups, opt.fp32_groups_gradients, strict=True)
        ]
        self.counted = self._counted_gradients()
        # DeepSpeed sums the squares over the model-parallel group (stages and tensor ranks);
        # over a group of one rank that all-reduce is a host round trip that changes nothing
        group = None if opt.mpu is None else opt.mpu.get_model_parallel_group()
        self.norm_group = group if group is not None and dist.get_world_size(group) > 1 else None
        # per group: the accumulators hold the last step's gradients, to be read as zero
        self.stale = [False] * len(opt.bf16_groups)
        opt.update_hp_grads = self.update_hp_grads
        opt.clear_hp_grads = self.clear_hp_grads
        opt.step = self.step

    def _counted_gradients(self) -> list[torch.Tensor]:
        """The accumulators DeepSpeed's ``get_grads_for_norm`` lists (less its per-step test
        of which got a gradient: the others are zero)."""
        from deepspeed.runtime.utils import (
            bwc_tensor_model_parallel_rank,
            is_model_parallel_parameter,
        )

        tp_rank = bwc_tensor_model_parallel_rank(mpu=self.opt.mpu)
        out = []
        for lps, hps in zip(self.opt.bf16_groups, self.opt.fp32_groups_gradients, strict=True):
            for lp, hp in zip(lps, hps, strict=True):
                if getattr(lp, "ds_pipe_replicated", False):
                    continue
                if tp_rank == 0 or is_model_parallel_parameter(lp):
                    out.append(hp)
        return out

    @torch.no_grad()
    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        opt = self.opt
        for i, lps in enumerate(opt.bf16_groups):
            got = [j for j, lp in enumerate(lps) if lp.grad is not None]
            if not got:
                continue
            grads = [lps[j].grad for j in got]
            accumulators = [self.accumulators[i][j] for j in got]
            if self.stale[i]:
                torch._foreach_copy_(accumulators, grads)
                if len(got) < len(lps):  # those without a gradient read as zero
                    missing = set(range(len(lps))) - set(got)
                    torch._foreach_zero_([self.accumulators[i][j] for j in sorted(missing)])
                self.stale[i] = False
            else:
                torch._foreach_add_(accumulators, grads)
            for j in got:
                lps[j]._hp_grad = opt.fp32_groups_gradients[i][j]
                opt.fp32_groups_has_gradients[i][j] = True
            if clear_lp_grads:
                torch._foreach_zero_(grads)

    def clear_hp_grads(self) -> None:
        """DeepSpeed's clear, less the zeroing (module docstring)."""
        opt = self.opt
        for i, group in enumerate(opt.fp32_groups_gradients):
            opt.fp32_groups_has_gradients[i] = [False] * len(group)
            self.stale[i] = True

    def _zero_stale(self) -> None:
        """Zero the accumulators of groups that got no gradient since the last clear."""
        for i, flat in enumerate(self.opt.fp32_groups_gradients_flat):
            if self.stale[i]:
                flat.zero_()
                self.stale[i] = False

    def global_norm(self) -> torch.Tensor:
        """DeepSpeed's count-once L2 norm of the accumulated gradients (-1 where not finite)."""
        from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

        opt = self.opt
        if self.counted:
            norms = torch._foreach_norm(self.counted)
            total = torch.stack(norms).pow(2.0).sum()
        else:  # a rank may count nothing (only replicated parameters on tensor rank > 0)
            flat = opt.fp32_groups_gradients_flat[0]
            total = torch.zeros((), dtype=torch.float32, device=flat.device)
        if self.norm_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.norm_group)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=total.device)
        return total

    @torch.no_grad()
    def step(self, closure=None):
        from deepspeed.runtime.utils import is_invalid_grad_norm

        if closure is not None:
            raise NotImplementedError(f"{type(self.opt).__name__} does not support closure.")
        opt = self.opt
        opt.overflow = False
        self.settle()  # the last step's skip, before this step's update reads the LR
        self._zero_stale()
        norm = self.global_norm()
        opt._global_grad_norm = norm
        if self.deferred is None and is_invalid_grad_norm(norm):  # waits for the device
            opt.overflow = True
            opt._global_grad_norm = float("inf")
            opt.clear_hp_grads()
            opt.clear_lp_grads()
            return
        if opt.clip_grad > 0.0:
            factor = (opt.clip_grad / (norm + CLIP_EPS)).clamp(max=1.0)
            # the flat accumulators: every gradient, plus alignment padding that stays zero
            torch._foreach_mul_(opt.fp32_groups_gradients_flat, factor)
        for param, grad in zip(
            opt.fp32_groups_flat_partition, opt.fp32_groups_gradient_flat_partition, strict=True
        ):
            param.grad = grad
        if self.deferred is not None:  # the fused AdamW leaves everything as it was at 1
            opt.optimizer.found_inf = self.deferred.found_inf(norm)
        opt.optimizer.step()
        opt.optimizer.found_inf = None
        opt._lazy_init_hp_params_optimizer_state()
        opt.update_lp_params()
        opt.clear_hp_grads()

    def settle(self) -> None:
        """Learn whether the last step was skipped on the device, if not learned yet; for a
        skipped one, DeepSpeed's infinite norm and the owner's ``on_skipped``."""
        if self.deferred is not None and self.deferred.settle():
            self.opt._global_grad_norm = float("inf")
            self.on_skipped()
