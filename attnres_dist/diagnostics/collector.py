"""The trainer-facing side of the instrumentation: when to measure, gathering, the file.

``Diagnostics(every_k, engine, ...)`` is created by the trainer; ``with diagnostics.step(n):``
wraps each optimizer step. Every ``every_k``-th step (``every_k = 0``: never, and the context
does nothing at all):

1. an ``ActivationProbe`` is attached to the local AttnRes layers and the final aggregation;
   it records the first micro-batch that passes each of them (the first micro-batch of the
   step, on every pipeline stage) and ignores the rest;
2. gradient norms are read at the engine's clipping point (the accumulated gradients of the
   whole step, before clipping): through ``optimizer.grad_probe`` when the engine's optimizer
   offers one (the DeepSpeed pipeline's ``ClippedAdamW``, after the data-parallel and tied
   reductions), else through post-accumulation hooks (the single-process engine);
3. after the step every rank sends its part to rank 0 (``gather_object`` over the world; the
   activations of data/tensor rank 0 only, the gradient sums of data rank 0 only), which
   appends one ``{"kind": "measure"}`` line to ``RUN_DIR/diagnostics.jsonl``.

Every step is timed (wall clock on rank 0, the first step left out as warm-up). ``close()``
appends a ``{"kind": "timing"}`` line: the median measured and unmeasured step times (medians,
because a shared machine's load spikes would swamp a mean) and the overhead they imply, per
measured step and amortised over ``every_k`` steps; and ``instrument_s``, the median time
rank 0 spent inside the instrumentation itself (probe, gradient reads, gather, write), which
``instrument_share`` relates to a plain step. The step-time difference is the end-to-end
cost; the direct time is the steadier number when the machine is shared and steps jitter.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.diagnostics.grads import GradMeter, norms
from attnres_dist.diagnostics.probe import ActivationProbe
from attnres_dist.model.attnres_layer import AttnResLayer
from attnres_dist.model.embedding_head import FinalAggregation

FILENAME = "diagnostics.jsonl"


def root_module(engine) -> torch.nn.Module:
    for attr in ("module", "model"):
        module = getattr(engine, attr, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise TypeError(f"{type(engine).__name__} exposes no model as .module or .model")


class Diagnostics:
    def __init__(
        self,
        every_k: int,
        engine,
        plan: BlockPlan,
        coords: tuple[int, int, int] = (0, 0, 0),
        rank: int = 0,
        run_dir: str | Path = ".",
    ):
        self.every_k = every_k
        self.plan = plan
        self.rank = rank
        self.path = Path(run_dir) / FILENAME
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._instrument: list[float] = []  # seconds inside probe, gradient reads, gather, write
        if not every_k:
            return
        _, self.dp_rank, self.tp_rank = coords
        root = root_module(engine)
        self.layers = [m for m in root.modules() if isinstance(m, AttnResLayer)]
        self.finals = [m for m in root.modules() if isinstance(m, FinalAggregation)]
        self.probe = ActivationProbe()
        self.grads = GradMeter(self.layers, self.tp_rank)
        self.optimizer = getattr(engine, "optimizer", None)
        self._grad_sq: dict | None = None

    @classmethod
    def for_run(cls, cfg, engine, dims, rank: int) -> Diagnostics:
        """The instrumentation a run's config asks for (``metrics.every_k``)."""
        return cls(
            cfg.metrics.every_k,
            engine,
            cfg.model.block_plan(),
            dims.coords(rank),
            rank,
            cfg.output.run_dir,
        )

    def is_measured(self, step: int) -> bool:
        return bool(self.every_k) and step % self.every_k == 0

    def step(self, step: int):
        """Context around optimizer step ``step`` (1-based)."""
        if not self.every_k:
            return contextlib.nullcontext()
        return self._step(step)

    @contextlib.contextmanager
    def _step(self, step: int):
        measured = self.is_measured(step)
        start = time.perf_counter()
        if measured:
            self._arm()
        try:
            yield
        finally:
            if measured:
                self._disarm()
        if not measured:
            if step > 1:
                self._times[False].append(time.perf_counter() - start)
            return
        own = self.probe.seconds + self.grads.seconds
        gather_start = time.perf_counter()
        record = self._gather(step)
        if record is not None:
            now = time.perf_counter()
            record["step_time_s"] = round(now - start, 4)
            record["instrument_s"] = round(own + now - gather_start, 4)
            self._write(record)
        if step > 1:
            now = time.perf_counter()
            self._times[True].append(now - start)
            self._instrument.append(own + now - gather_start)

    # -- one measured step ------------------------------------------------------------------

    def _arm(self) -> None:
        self.probe.reset()
        self._grad_sq = None
        for module in (*self.layers, *self.finals):
            module.probe = self.probe
        if hasattr(self.optimizer, "grad_probe"):
            self.optimizer.grad_probe = self._read_grads
        else:
            self.grads.attach()

    def _read_grads(self) -> None:
        self._grad_sq = self.grads.read()

    def _disarm(self) -> None:
        for module in (*self.layers, *self.finals):
            module.probe = None
        if hasattr(self.optimizer, "grad_probe"):
            self.optimizer.grad_probe = None
        else:
            self._grad_sq = self.grads.detach()

    def _gather(self, step: int) -> dict | None:
        part = {
            "activations": self.probe.results()
            if self.dp_rank == 0 and self.tp_rank == 0
            else None,
            "grads": self._grad_sq if self.dp_rank == 0 else None,
        }
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [None] * dist.get_world_size() if self.rank == 0 else None
            dist.gather_object(part, parts, dst=0)
        else:
            parts = [part]
        if self.rank != 0:
            return None
        return self._merge(step, parts)

    def _merge(self, step: int, parts: list[dict]) -> dict:
        plan = self.plan
        sublayers: dict[int, dict] = {}
        final = None
        for part in parts:
            acts = part["activations"]
            if acts is None:
                continue
            sublayers.update(acts["sublayers"])
            final = acts["final"] if acts["final"] is not None else final
        grad_parts = [p["grads"] for p in parts if p["grads"] is not None]
        return {
            "kind": "measure",
            "step": step,
            "mode": plan.mode,
            "block_size": plan.effective_block_size,
            "num_layers": plan.num_layers,
            "sublayers": [sublayers.get(i) for i in range(1, plan.num_sublayers + 1)],
            "final": final,
            "grad_norm": norms(grad_parts, plan),
        }

    # -- output -----------------------------------------------------------------------------

    def _write(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def timing(self) -> dict:
        """Median step times and the measurement overhead so far (rank 0's clock)."""

        def median(values):
            return statistics.median(values) if values else None

        measured, plain = median(self._times[True]), median(self._times[False])
        instrument = median(self._instrument)
        out = {
            "kind": "timing",
            "every_k": self.every_k,
            "measured_steps": len(self._times[True]),
            "unmeasured_steps": len(self._times[False]),
            "measured_step_s": measured,
            "unmeasured_step_s": plain,
            "instrument_s": instrument,
            "overhead_per_measured_step": None,
            "overhead_amortised": None,
            "instrument_share": None,
        }
        if measured is not None and plain:
            extra = measured / plain - 1.0
            out["overhead_per_measured_step"] = extra
            out["overhead_amortised"] = extra / self.every_k
            out["instrument_share"] = instrument / plain
        return out

    def close(self) -> None:
        if self.every_k and self.rank == 0:
            self._write(self.timing())
