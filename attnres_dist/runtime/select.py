"""Choosing the fast paths at start-up, from the config's ``runtime`` section and the probes.

``auto`` takes a fast path when this machine has it and, on a GPU, when the GPU check has run
it (``gpu_checked.RUN_BY_GPU_CHECK``): DeepSpeed's bf16 engine on a GPU with bf16. Megatron-Core's
Transformer Engine layer spec, apex's fused RMSNorm and FusedAdam and CUDA graphs are GPU-only
and have not run in a GPU check, so ``auto`` leaves them out, saying so, and takes them only
where they are asked for by name (``te``, ``on``). Otherwise: the local layer spec, torch AdamW
and fp32, with the project's fused C RMSNorm where the C kernels build (``cpu``; else torch's). The
local spec's core attention is torch's ``scaled_dot_product_attention`` on every device
(``attnres_dist.model.sdpa_attention``; ``megatron`` keeps Megatron's unfused one); the TE
spec brings Transformer Engine's attention, so there the choice is TE's. An
explicit request is honoured or refused: asking for a path this machine cannot run is a
``ConfigError`` naming the field, before any process group starts, never a silent fallback.

bf16 is DeepSpeed's bf16 engine (``pipeline/precision.py``: bf16 parameters, fp32 master
weights in its optimizer). ``auto`` takes it on a GPU that supports bf16; it also runs on CPU
(DeepSpeed's CPU accelerator), where it is taken only when asked for explicitly.

The depth-attention backend (``model.attnres.impl``) is resolved here too: ``auto`` takes
fla-core's fused kernel (``fla``) on a CUDA device where it is installed, else the project's
Triton kernels (``triton``) where they run, else the torch two-phase ops (``twophase``); on a
CPU it takes the project's fused C kernels (``cpu_fused``) where they build, else
``twophase`` (docs/kernels.md has the measurements behind each choice).

So is the host allocator's policy (``runtime.cpu_allocator``): ``auto`` on a CPU run with
glibc keeps freed memory in the process (``attnres_dist.runtime.allocator``), which this
selection applies, since it holds for the whole process from then on.

Whether each transformer layer (and the final aggregation) runs as one ``torch.compile``
graph (``runtime.compile``: ``layer``; ``chunk``: each run of a stage's consecutive layers one
graph; ``off``: eagerly) is chosen here as well. A compiled layer needs ops the compiler
sees: the torch two-phase depth attention (``twophase``) and torch's RMSNorm, so ``layer`` and
``chunk`` resolve ``auto`` to those and refuse the fused C depth-attention kernels and apex's
norm by name; the C RMSNorm (registered ops) is kept when asked for. ``auto`` compiles only
where it was measured to pay (``COMPILE_AUTO``): not on a CPU, where compiling the layers costs more
than a whole ``make train`` run gains (docs/compile.md), and not yet on a GPU, where it has
not been measured.

A compiled run's training steps check only the guards telling cache entries apart once a step
compiled nothing (``runtime.guards``: ``auto``, ``steady``; ``full``: all; ``SteadyGuards``).

CUDA graphs (``runtime.cuda_graphs: on``) replay each compiled region as CUDA graph trees
(``torch.compile``'s reduce-overhead, ``compiled_region.compile_region``); ``on`` needs
``runtime.compile: layer`` or ``chunk`` and a CUDA device, and ``auto`` leaves it out until
the GPU check has run it.

Every choice carries the reason it was made; ``RuntimeChoice.describe()`` is the one line the
trainer prints at start-up.
"""

from __future__ import annotations

from attnres_dist.config.schema import COMPILED
from attnres_dist.errors import ConfigError
from attnres_dist.ops import runnable_depth_attention_impls
from attnres_dist.runtime import allocator, gpu_checked, probes
from attnres_dist.runtime.choice import Choice, RuntimeChoice

IMPL_FIELD = "model.attnres.impl"


class _Probes:
    """Each probe run at most once per selection, and only when a decision needs it."""

    def __init__(self):
        self._seen: dict[str, probes.Probe] = {}

    def get(self, name: str) -> probes.Probe:
        if name not in self._seen:  # looked up on the module at call time: tests replace them
            self._seen[name] = getattr(probes, name)()
        return self._seen[name]


def _pick(
    p: _Probes,
    field: str,
    requested: str,
    fast: str,
    plain: str,
    plain_word: str,
    probe_name: str,
    fast_word: str = "on",
) -> Choice:
    """One decision. ``auto``: the fast path when CUDA and the probe allow it and the GPU check
    has run it (``gpu_checked``), else the plain one, with the reason. ``plain_word``: the plain
    path. ``fast_word`` (the config's word for the fast path): the fast path or a ConfigError
    naming the field."""
    where = f"runtime.{field}"
    if requested == plain_word:
        return Choice(plain, "set in config")
    cuda = p.get("cuda")
    if not cuda.ok:
        if requested == "auto":
            return Choice(plain, "no GPU")  # the device entry of the report says why
        raise ConfigError(
            where, f"{requested!r} needs a CUDA device ({cuda.detail}); use auto or {plain_word}"
        )
    path = f"{field}={fast}"
    if requested == "auto" and path in gpu_checked.RUN_BY_GPU_CHECK:
        if not gpu_checked.has_run(path):  # not even probed: an opt-in path stays out of auto
            return Choice(plain, gpu_checked.not_run_reason(path, field, fast_word))
    probe = p.get(probe_name)
    if not probe.ok:
        if requested == "auto":
            return Choice(plain, probe.detail)
        raise ConfigError(
            where, f"{requested!r} requested but {probe.detail}; use auto or {plain_word}"
        )
    return Choice(fast, probe.detail if requested == "auto" else f"set in config; {probe.detail}")


# what auto does on each device, and why (measured: docs/compile.md)
COMPILE_AUTO = {
    "cpu": Choice("off", "auto: on CPU compiling the layers costs more than a run gains"),
    "cuda": Choice("off", "auto: not yet measured to pay on a GPU"),
}
# the depth-attention implementations a compiled layer traces (torch ops, no opaque kernel)
COMPILABLE_IMPLS = ("twophase", "reference")


COMPILE_REGIONS = {
    "layer": "torch.compile per transformer layer, fullgraph",
    "chunk": "torch.compile per run of a stage's layers (a chunk; full recompute: a group), "
    "fullgraph",
}


def select_compile(requested: str, device: str) -> Choice:
    """Resolve ``runtime.compile`` (``auto``, ``off``, ``layer`` or ``chunk``) for ``device``."""
    if requested == "auto":
        return COMPILE_AUTO[device]
    if requested in COMPILE_REGIONS:
        return Choice(requested, f"set in config; {COMPILE_REGIONS[requested]}")
    return Choice("off", "set in config")


def select_cuda_graphs(requested: str, cuda: probes.Probe, compiled: bool) -> Choice:
    """Resolve ``runtime.cuda_graphs`` (``auto``, ``off`` or ``on``). ``on`` needs a CUDA
    device (the config rules already required ``runtime.compile: layer``); ``auto`` takes it
    with compiled layers on a GPU once the GPU check has run it (``gpu_checked``)."""
    where = "runtime.cuda_graphs"
    if requested == "off":
        return Choice("off", "set in config")
    if not cuda.ok:
        if requested == "auto":
            return Choice("off", "no GPU")
        raise ConfigError(where, f"'on' needs a CUDA device ({cuda.detail}); use auto or off")
    if requested == "on" and not compiled:  # the config rules say so too; a built config may not
        raise ConfigError(where, "'on' replays compiled layers; set runtime.compile=layer or off")
    if requested == "on":
        return Choice("on", "set in config; CUDA graph trees over each compiled layer")
    if not gpu_checked.has_run("cuda_graphs=on"):
        return Choice("off", gpu_checked.not_run_reason("cuda_graphs=on", "cuda_graphs", "on"))
    if not compiled:
        return Choice("off", "auto: CUDA graphs replay compiled layers; runtime.compile is off")
    return Choice("on", "auto: run by the GPU check; CUDA graph trees over each compiled layer")


def select_depth_attention(requested: str, device: str, compiled: bool = False) -> Choice:
    """Resolve ``model.attnres.impl`` (``auto`` or a registered name) for ``device``;
    ``compiled``: for a compiled layer (``COMPILABLE_IMPLS`` only)."""
    why_not = runnable_depth_attention_impls()
    if compiled:
        if requested == "auto":
            return Choice("twophase", "auto: torch two-phase ops, which a compiled layer traces")
        if requested not in COMPILABLE_IMPLS and requested in why_not:
            raise ConfigError(
                IMPL_FIELD,
                f"{requested!r} is not traced by a compiled layer (runtime.compile=layer or "
                f"chunk); use auto or one of {', '.join(COMPILABLE_IMPLS)}, or runtime.compile=off",
            )
    if requested == "auto":
        if device == "cuda":
            # fla's fused kernel first, then the project's Triton kernels (docs/kernels.md)
            fla = why_not.get("fla", "not registered")
            if fla is None:
                return Choice("fla", "auto: CUDA device and fla-core's fused_attnres kernel")
            triton = why_not.get("triton", "not registered")
            if triton is None:
                return Choice("triton", f"auto: CUDA device and the Triton kernel (fla: {fla})")
            return Choice("twophase", f"auto: torch two-phase ops (triton: {triton})")
        reason = why_not.get("cpu_fused", "not registered")
        if reason is None:
            return Choice("cpu_fused", "auto: CPU and the fused C two-phase kernels built here")
        return Choice("twophase", f"auto: torch two-phase ops (cpu_fused: {reason})")
    if requested not in why_not:
        allowed = ", ".join(["auto", *why_not])
        raise ConfigError(IMPL_FIELD, f"got {requested!r}; allowed: {allowed}")
    if why_not[requested] is not None:
        here = ", ".join(["auto", *(name for name, why in why_not.items() if why is None)])
        raise ConfigError(
            IMPL_FIELD,
            f"{requested!r} cannot run here: {why_not[requested]}; available here: {here}",
        )
    return Choice(requested, "set in config")


def select_runtime(runtime, depth_attention: str = "auto", moe: bool = False) -> RuntimeChoice:
    """Resolve a ``RuntimeConfig`` (``auto`` or explicit values) against this machine, with
    the model's depth-attention implementation (``model.attnres.impl``); ``moe``: the model
    has MoE layers, which run Megatron's local spec (the config rules refuse ``te``)."""
    p = _Probes()
    cuda = p.get("cuda")
    device = Choice("cuda" if cuda.ok else "cpu", cuda.detail)
    compile_choice = select_compile(runtime.compile, device.value)
    compiled = compile_choice.value in COMPILED
    cuda_graphs = select_cuda_graphs(runtime.cuda_graphs, cuda, compiled)
    backend = Choice(runtime.compile_backend, "set in config") if compiled else None
    guards = _guards(runtime.guards) if compiled else None
    if moe:
        layer_spec = Choice("local", "MoE layers: Megatron's local spec (SequentialMLP experts)")
    else:
        layer_spec = _pick(
            p, "layer_spec", runtime.layer_spec, "te", "local", "local", "transformer_engine", "te"
        )
    if compiled and layer_spec.value == "te":
        raise ConfigError(
            "runtime.compile",
            f"{compile_choice.value!r} runs the local layer spec only, but layer_spec=te "
            f"({layer_spec.reason}); set runtime.layer_spec=local or runtime.compile=off",
        )
    if compiled and runtime.fused_norm != "on":
        norm = Choice("torch", "torch RMSNorm, which a compiled layer traces")
    elif compiled and cuda.ok:
        raise ConfigError(
            "runtime.fused_norm",
            "'on' is apex's kernel, which a compiled layer does not trace "
            "(runtime.compile=layer or chunk); use auto or off, or runtime.compile=off",
        )
    elif compiled:  # the C RMSNorm: registered ops, which a compiled layer keeps whole
        norm = _norm(p, "on")
    else:
        norm = _norm(p, runtime.fused_norm)
    if norm.value == "apex" and layer_spec.value == "te":
        # the TE spec fuses each layer's norms into its linears; apex normalises the final output
        norm = Choice("apex", f"{norm.reason}; final norm only, TE fuses the layers' norms")
    optimizer = _pick(
        p, "fused_optimizer", runtime.fused_optimizer, "apex", "torch", "off", "apex_adam"
    )
    if runtime.dtype == "bf16" and not cuda.ok:  # DeepSpeed's bf16 engine runs on CPU too
        dtype = Choice("bf16", "set in config; on CPU")
    else:
        dtype = _pick(p, "dtype", runtime.dtype, "bf16", "fp32", "fp32", "bf16")
    if dtype.value == "bf16":
        dtype = Choice("bf16", f"{dtype.reason}; DeepSpeed bf16 engine, fp32 master weights")
    core_attention = _core_attention(runtime.core_attention, layer_spec)
    impl = select_depth_attention(depth_attention, device.value, compiled)
    cpu_allocator = _cpu_allocator(p, runtime.cpu_allocator)
    return RuntimeChoice(
        device,
        layer_spec,
        norm,
        optimizer,
        dtype,
        core_attention,
        impl,
        cpu_allocator,
        compile_choice,
        cuda_graphs,
        backend,
        guards,
    )


def _guards(requested: str) -> Choice:
    """The guard stance of a compiled run's training steps (``steady`` needs compiled layers)."""
    if requested == "full":
        return Choice("full", "set in config; every guard on every call")
    why = "a step that compiled nothing, then only the guards telling cache entries apart"
    return Choice("steady", f"set in config; {why}" if requested == "steady" else f"auto: {why}")


def _cpu_allocator(p: _Probes, requested: str) -> Choice:
    """``retain`` (applied here, to the whole process) on a CPU run with glibc, or when asked
    for; else the C library's own policy (``system``). On a GPU the activations live in the
    CUDA caching allocator, so ``auto`` leaves the host's alone."""
    if requested == "system":
        return Choice("system", "set in config")
    if requested == "auto" and p.get("cuda").ok:
        return Choice("system", "GPU: activations live in the CUDA caching allocator")
    libc = p.get("glibc_malloc")
    if not libc.ok:
        if requested == "auto":
            return Choice("system", libc.detail)
        raise ConfigError(
            "runtime.cpu_allocator",
            f"'retain' needs glibc's mallopt but {libc.detail}; use auto or system",
        )
    allocator.retain_freed_memory()
    why = "freed memory kept for reuse, no mmap, no trim"
    return Choice(
        "retain", f"{libc.detail}: {why}" if requested == "auto" else f"set in config; {why}"
    )


def _norm(p: _Probes, requested: str) -> Choice:
    """The layers' and the final RMSNorm: apex's on a GPU, the project's C kernel on a CPU,
    else torch's (``off``: torch's everywhere)."""
    if p.get("cuda").ok or requested == "off":
        return _pick(p, "fused_norm", requested, "apex", "torch", "off", "apex_norm")
    kernels = p.get("cpu_kernels")
    if kernels.ok:
        return Choice("cpu", kernels.detail if requested == "auto" else "set in config; on CPU")
    if requested == "auto":
        return Choice("torch", kernels.detail)
    raise ConfigError(
        "runtime.fused_norm", f"'on' requested on CPU but {kernels.detail}; use auto or off"
    )


def _core_attention(requested: str, layer_spec: Choice) -> Choice:
    """SDPA unless Megatron's own is asked for; under the TE spec, TE's (nothing to choose)."""
    if layer_spec.value == "te":
        if requested == "auto":
            return Choice("te", "Transformer Engine's, part of the te layer spec")
        raise ConfigError(
            "runtime.core_attention",
            f"{requested!r} applies to the local layer spec but layer_spec=te "
            f"({layer_spec.reason}); use auto or set runtime.layer_spec=local",
        )
    if requested == "auto":
        return Choice("sdpa", "torch scaled_dot_product_attention")
    return Choice(requested, "set in config")
