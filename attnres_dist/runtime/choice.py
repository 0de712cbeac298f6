"""What a run's fast-path selection decided: one ``Choice`` (value and reason) per decision.

``RuntimeChoice`` is the result of ``runtime/select.py``'s ``select_runtime``: the device,
layer spec, norm, optimizer, precision, attention, depth-attention implementation, host
allocator and compile choices, with the properties the model and the engines read
(``compiled``, ``graphed``, ``steady_guards``, ``bf16``) and ``describe()``, the one
``runtime:`` line the trainer prints at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from attnres_dist.config.schema import COMPILED


@dataclass(frozen=True)
class Choice:
    value: str
    reason: str


@dataclass(frozen=True)
class RuntimeChoice:
    device: Choice  # cuda | cpu
    layer_spec: Choice  # te | local
    norm: Choice  # apex | cpu | torch
    optimizer: Choice  # apex | torch
    dtype: Choice  # bf16 | fp32
    # sdpa | megatron | te (the TE spec's own); hand-built choices get the reference one
    core_attention: Choice = Choice("megatron", "reference path")
    # a registered implementation name; None: the builder resolves the model config's impl
    depth_attention: Choice | None = None
    # retain | system: the host allocator's policy for freed memory (runtime/allocator.py)
    cpu_allocator: Choice | None = None
    # layer | off: each transformer layer (and the final aggregation) one torch.compile graph
    compile: Choice | None = None
    # on | off: the compiled layers replayed as CUDA graphs (compile mode reduce-overhead)
    cuda_graphs: Choice | None = None
    # inductor | aot_eager | eager: the compiled layers' backend (only when compiled)
    compile_backend: Choice | None = None
    guards: Choice | None = None  # steady | full: the guards a training step evaluates

    @classmethod
    def reference(cls) -> RuntimeChoice:
        """The plain path (local spec, torch ops, fp32 on CPU) for callers that pass no choice."""
        why = "reference path"
        return cls(
            Choice("cpu", why),
            Choice("local", why),
            Choice("torch", why),
            Choice("torch", why),
            Choice("fp32", why),
            Choice("megatron", why),
        )

    @classmethod
    def plain(cls, device: str) -> RuntimeChoice:
        """The plain path (local spec, torch ops, fp32) on ``device`` (``cpu`` or ``cuda``): what
        export and generate run, whatever the machine or the spec that trained the model."""
        if device == "cpu":
            return cls.reference()
        why = "plain path for a single-process model"
        return cls(
            Choice(device, "requested"),
            Choice("local", why),
            Choice("torch", why),
            Choice("torch", why),
            Choice("fp32", why),
        )

    @property
    def on_gpu(self) -> bool:
        return self.device.value == "cuda"

    @property
    def compiled(self) -> bool:
        """The transformer layers (each, or each run of a stage's: ``chunked``) and the final
        aggregation run as torch.compile graphs."""
        return self.compile is not None and self.compile.value in COMPILED

    @property
    def chunked(self) -> bool:
        """One compiled graph per run of a stage's consecutive layers (``runtime.compile:
        chunk``)."""
        return self.compile is not None and self.compile.value == "chunk"

    @property
    def graphed(self) -> bool:
        """The compiled layers run as CUDA graph trees (``torch.compile``'s reduce-overhead)."""
        return self.cuda_graphs is not None and self.cuda_graphs.value == "on"

    @property
    def steady_guards(self) -> bool:
        """Training steps evaluate only the guards telling cache entries apart (SteadyGuards)."""
        return self.guards is not None and self.guards.value == "steady"

    @property
    def bf16(self) -> bool:
        """DeepSpeed's bf16 engine (bf16 parameters, fp32 master weights)."""
        return self.dtype.value == "bf16"

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of activations and of the stage-to-stage payloads."""
        return torch.bfloat16 if self.bf16 else torch.float32

    def describe(self) -> str:
        choices = {f.name: getattr(self, f.name) for f in fields(self)}
        choices = {k: c for k, c in choices.items() if c is not None}
        return "runtime: " + "; ".join(f"{k}={c.value} ({c.reason})" for k, c in choices.items())
