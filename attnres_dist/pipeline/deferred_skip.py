"""The bf16 optimizer's skip of a step with a non-finite gradient norm, decided on the device and
learned by the host one step later.

DeepSpeed's ``BF16_Optimizer`` skips a step whose gradient norm is not finite: no update, the LR
schedule not advanced, ``skipped_steps`` counted. It decides on the host (``if
is_invalid_grad_norm(norm)``), which makes the host wait for the device's whole backward every
step, so the next step's kernels are only queued once the device has gone idle.

Here the device decides and the host learns later, to the same effect:

* the update: torch's fused AdamW takes a ``found_inf`` flag (as under ``torch.amp.GradScaler``)
  and leaves parameters, moments and step counts as they were where it is 1;
* the flag goes to a host buffer by a copy that does not block (pinned memory and an event on a
  GPU), and is read at the next point that needs it: the next step's optimizer step, before its
  update (by then the device finished the flag long ago, since the next step's forward and
  backward were queued after it), or a read of the LR, the gradient norm or the schedule for a
  log or a checkpoint (which wait for the device anyway);
* DeepSpeed's engine saw no overflow and advanced the schedule; when the read says the step was
  skipped, the owner counts it and takes the schedule back one step, before anything used the
  advanced LR. So every update and every LR read is DeepSpeed's own.

Only where the inner optimizer is torch's fused Adam(W) (apex's FusedAdam has no ``found_inf``)
and the schedule a ``LambdaLR`` (one whose LR is a function of its step, so going back one step
is exact); elsewhere the bookkeeping reads the norm on the host, as DeepSpeed does.
"""

from __future__ import annotations

import torch


def deferrable(inner: torch.optim.Optimizer, scheduler) -> bool:
    """Whether ``inner`` (the optimizer DeepSpeed's wrapper steps) can skip on the device and
    ``scheduler`` go back a step exactly."""
    fused = isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and inner.defaults.get("fused")
    return bool(fused) and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)


def step_back(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Undo the last ``scheduler.step()``: its step counts (both are in its ``state_dict``, so
    in a checkpoint) and the LR it set on every group."""
    scheduler.last_epoch -= 2
    scheduler._step_count -= 2
    scheduler.step()  # LambdaLR's LR is a function of last_epoch alone


class DeferredSkip:
    """The last step's "skipped" flag, on its way to the host."""

    def __init__(self, device: torch.device):
        on_gpu = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.bool, pin_memory=on_gpu)
        self.ready = torch.cuda.Event() if on_gpu else None
        self.pending = False

    def found_inf(self, norm: torch.Tensor) -> torch.Tensor:
        """Record whether ``norm`` (DeepSpeed's, -1 where not finite) makes this step skipped,
        and return the flag as the fused AdamW takes it (a float 1 or 0 on the device)."""
        invalid = (~torch.isfinite(norm)) | (norm < 0)  # DeepSpeed's is_invalid_grad_norm
        self.host.copy_(invalid, non_blocking=True)
        if self.ready is not None:
            self.ready.record()
        self.pending = True
        return invalid.to(torch.float32)

    def settle(self) -> bool:
        """Whether the last step not read yet was skipped (False where every step was read):
        waits only for that step's norm."""
        if not self.pending:
            return False
        self.pending = False
        if self.ready is not None:
            self.ready.synchronize()
        return bool(self.host)  # a host tensor: no device read
