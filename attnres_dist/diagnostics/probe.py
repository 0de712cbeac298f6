"""Activation measurements of one micro-batch: what each sublayer reads, writes and attends to.

``ActivationProbe`` is what the model's hook points (``AttnResLayer.probe``,
``FinalAggregation.probe``) call while it is attached. It records, once per sublayer (the first
micro-batch that reaches it; activation recompute later re-runs the forward and is ignored):

* ``in_rms``: RMS of what the sublayer reads before its PreNorm, the mix ``x_l`` (baseline: the
  residual stream ``h_l``);
* ``out_rms``: RMS of its raw output ``v_l``;
* ``state_rms``: RMS of the running state after it: the partial block (AttnRes; it restarts at
  every block boundary) or the residual stream (baseline);
* depth-attention weights (AttnRes only): the mean weight of each source over tokens, the mean
  over tokens of the largest weight, and the mean per-token entropy in nats (``log n`` when
  uniform, 0 when one source takes everything).

Everything is computed under ``no_grad`` from tensors the forward pass already has (the mix is
recomputed with ``return_weights=True``), so the training graph and its saved tensors are the
same whether a probe is attached or not. Values stay tensors until ``results()``, so a GPU
forward pass is not synchronised sublayer by sublayer. ``seconds`` is the wall time spent in
the probe (host side: on a GPU, kernels it queues finish later).
"""

from __future__ import annotations

import time

import torch


def rms(t: torch.Tensor) -> torch.Tensor:
    """Root mean square over every element, in float32 (float64 stays float64)."""
    t = t.detach()
    return t.to(torch.promote_types(t.dtype, torch.float32)).pow(2).mean().sqrt()


def weight_stats(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summary of depth-attention weights ``[n, ...]`` (softmax over dim 0) over the tokens."""
    w = weights.detach().reshape(weights.shape[0], -1)
    entropy = -torch.special.xlogy(w, w).sum(dim=0)  # xlogy: 0 * log 0 = 0
    return {
        "mean": w.mean(dim=1),
        "max": w.max(dim=0).values.mean(),
        "entropy": entropy.mean(),
    }


def _to_python(value):
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.ndim else value.item()
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    return value


class ActivationProbe:
    """Collects per-sublayer statistics for one micro-batch (see the module docstring)."""

    def __init__(self):
        self._sublayers: dict[int, dict] = {}
        self._final: dict | None = None
        self.seconds = 0.0

    def reset(self) -> None:
        self._sublayers.clear()
        self._final = None
        self.seconds = 0.0

    @staticmethod
    def _mix(mixer, sources) -> tuple[torch.Tensor, dict]:
        x, weights = mixer(sources, return_weights=True)
        return x, dict(weight_stats(weights), num_sources=len(sources))

    def sublayer(self, layer, sublayer: int, state, out: torch.Tensor) -> None:
        """Called by ``AttnResLayer._sublayer`` with the state it read and its output ``v``."""
        if sublayer in self._sublayers:
            return  # a recompute pass, or a later micro-batch
        start = time.perf_counter()
        self._sublayers[sublayer] = self._measure_sublayer(layer, sublayer, state, out)
        self.seconds += time.perf_counter() - start

    @torch.no_grad()
    def _measure_sublayer(self, layer, sublayer: int, state, out: torch.Tensor) -> dict:
        record = {"sublayer": sublayer, "layer": layer.layer_index}
        if layer.plan.mode == "baseline":
            x = state.partial
        else:
            mixer = layer.attn_mixer if sublayer % 2 == 1 else layer.mlp_mixer
            if mixer.delta:  # the mix of the completed blocks, added to the stream
                x, record["weights"] = self._mix(mixer, list(state.completed))
                x = x + state.stream()
            else:
                x, record["weights"] = self._mix(mixer, state.sources())
            record["weights"]["num_completed"] = len(state.completed)
        after = out if state.partial is None else state.partial + out
        record.update(in_rms=rms(x), out_rms=rms(out), state_rms=rms(after))
        return record

    def final(self, aggregation, state, hidden: torch.Tensor) -> None:
        """Called by ``FinalAggregation.forward`` with its input state and pre-norm output."""
        if self._final is not None:
            return
        start = time.perf_counter()
        with torch.no_grad():
            record = {"rms": rms(hidden)}
            if aggregation.plan.has_final_mix:
                _, record["weights"] = self._mix(aggregation.mixer, state.sources())
                record["weights"]["num_completed"] = len(state.completed)
        self._final = record
        self.seconds += time.perf_counter() - start

    def results(self) -> dict:
        """``{"sublayers": {i: record}, "final": record or None}`` as plain Python values."""
        start = time.perf_counter()
        try:
            return self._results()
        finally:
            self.seconds += time.perf_counter() - start

    def _results(self) -> dict:
        return {
            "sublayers": {i: _to_python(r) for i, r in self._sublayers.items()},
            "final": _to_python(self._final),
        }
