"""The single-process engine: the reference every parallel layout is compared against.

One optimizer step = forward and backward over each micro-batch (loss scaled by 1/M so the
gradients are those of the mean loss), optional global-norm clipping, AdamW, LR schedule:
the same arithmetic DeepSpeed's pipeline engine performs, in plain PyTorch.
"""

from __future__ import annotations

import torch

from attnres_dist.config import OptimConfig
from attnres_dist.data.device_copy import to_device
from attnres_dist.model.compiled_region import SteadyGuards
from attnres_dist.model.gpt import AttnResGPT
from attnres_dist.model.moe import is_moe, set_aux_loss_scale
from attnres_dist.optim import build_optimizer


class LocalEngine:
    def __init__(self, model: AttnResGPT, optim: OptimConfig, total_steps: int):
        self.model = model
        self.guards = SteadyGuards(model.steady_guards)  # each training step's stance
        self.grad_clip = optim.grad_clip
        self.optimizer, self.scheduler = build_optimizer(model, optim, total_steps)
        self._grad_norm: torch.Tensor | None = None  # read as a number only when logged
        self.moe = any(is_moe(m) for m in model.modules())  # router losses to scale

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One optimizer step; the mean loss as a 0-d tensor, not read here (reading it waits
        for the device: the trainer reads it on the steps it logs or saves)."""
        self._mark_step()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # as Python floats sum
        # on a GPU: queued copies from pinned memory, all before the first forward
        micro_batches = [to_device(window, self.device) for window in micro_batches]
        if self.moe:  # the router losses' gradients, scaled as the mean loss's
            set_aux_loss_scale(len(micro_batches), self.device)
        with self.guards.step():
            for window in micro_batches:
                loss = self.model.loss(window)
                (loss / len(micro_batches)).backward()
                total += loss.detach()
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        else:  # not clipped, but still logged
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
        self._grad_norm = norm
        self.optimizer.step()
        self.scheduler.step()
        return total / len(micro_batches)

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global norm before clipping; reading it waits for the device."""
        return None if self._grad_norm is None else self._grad_norm.item()

    @torch.no_grad()
    def eval_loss(self, batches: list[torch.Tensor]) -> float:
        self._mark_step()
        self.model.eval()
        losses = [self.model.loss(window).item() for window in batches]
        return sum(losses) / len(losses)

    def _mark_step(self) -> None:
        """A new generation of the CUDA graph trees, when the layers replay as graphs."""
        if self.model.graphed:
            torch.compiler.cudagraph_mark_step_begin()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def named_parameters(self):
        return self.model.named_parameters()

    def checkpoint_params(self) -> list[tuple[str, torch.nn.Parameter, bool]]:
        """(canonical name, parameter, owned): the single-process names are canonical."""
        return [(name, p, True) for name, p in self.model.named_parameters()]

    def restored(self, step: int) -> None:
        """Nothing beyond the optimizer and schedule counts steps here."""

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter by its canonical name (the single-process names), on the CPU."""
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters()}
