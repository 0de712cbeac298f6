"""How a part of the model becomes one ``torch.compile`` region (``runtime.compile``).

Each transformer layer's two sublayers (``AttnResLayer.sublayers``, ``layer``) or each run of
a chunk's consecutive layers (``LayerRun.sublayers``, ``chunk``; ``model/layer_runs.py``) and
the final aggregation with its norm (``FinalAggregation.aggregate``) are compiled this way:
``fullgraph`` (a graph break is an error, never a silent split) and static shapes (each layer
is its own graph anyway: its block structure is Python control flow, so dynamic shapes would
only add guards). Each region gets a code object of its own (``_own_code``): TorchDynamo keeps
its compiled graphs per code object, so a region's cache holds only its own entries (train,
eval; under full recompute, its recompute pass) and a call never walks other layers' entries.
Inductor draws dropout masks from torch's generator as eager does (``fallback_random``), so
the layout-independent streams (``model/dropout_streams.py``) and the eager reference see the
same masks. Inductor's run-time size and alignment assertions are off in these regions: on
every call they re-check what was settled when the graph was compiled (the sizes and strides
of the inputs: Dynamo guards the forward's, and the backward's come from the region's own
forward; the output layouts of its fallback kernels, which inductor chose), one host call
each (docs/profiling.md has what they cost).

``cuda_graphs``: inductor's ``triton.cudagraphs`` (what mode ``reduce-overhead`` sets; a mode
and options cannot be given together): each region's forward and backward replay as CUDA graph
trees, which share one memory pool, keep a graph per live-tensor path (several micro-batches in
flight, recompute) and read dropout's Philox seed and offset from the generator at replay, so
re-seeding the streams before a replay holds. The engines mark each step's start
(``torch.compiler.cudagraph_mark_step_begin``).

``SteadyGuards`` (``runtime.guards: steady``): once a training step has run with every guard
and compiled nothing, the following training steps run under TorchDynamo's
``skip_guard_eval_unsafe`` stance, which evaluates only the guards that tell a code object's
cache entries apart: the shapes, strides and dtypes of the non-parameter tensors a region takes,
and every guard that has failed once (a layer's index, the train / eval mode after an
evaluation compiled its entries). The rest (about 750 entries per region on Megatron's
submodules' attributes and the parameters' metadata) checks what cannot change between training
steps. What keeps that true: a region reads nothing from Python that varies between steps of
one run (the diagnostics hook is checked outside the regions, ``AttnResLayer.forward``),
and any compile anywhere (an evaluation's first pass, a new shape) sends the next step back to
every guard. Evaluations run with every guard: sharing the stance would let an evaluation's
first pass pick a training graph, before the train / eval guard has ever failed (what it
saves: docs/compile.md).
"""

from __future__ import annotations

import contextlib
import itertools
import types


def compile_region(method, backend: str = "inductor", cuda_graphs: bool = False):
    """The bound ``method`` as one compiled region."""
    import torch._dynamo  # only where something is compiled

    config = torch._dynamo.config
    # a region over several layers reaches shared objects (the block plan, two-phase segments
    # spanning layers) by several paths; Dynamo guards that they are still one object, by
    # default in a Python function run on every call, which steady guards do not skip; as
    # tree guards they are the same checks in C++
    config.use_lamba_guard_for_object_aliasing = False
    options = None
    if backend == "inductor":  # (module docstring)
        options = {"fallback_random": True, "size_asserts": False, "alignment_asserts": False}
    if cuda_graphs:
        options = {**(options or {}), "triton.cudagraphs": True}
    return torch.compile(
        _own_code(method), backend=backend, fullgraph=True, dynamic=False, options=options
    )


def state_region(method):
    """The bound ``method(state, *args) -> state`` (a layer's sublayers, a chunk's run of
    layers) as a region runs it: the depth state enters as a value (``DepthState.in_region``:
    appends are ``torch.cat``s the compiler sees) and leaves as ``DepthState.out_of_region``
    hands it on. Eager, the method runs on the state as it is."""

    def region(self, state, *args):
        return method(state.in_region(), *args).out_of_region()

    region.__name__ = region.__qualname__ = method.__name__
    return types.MethodType(region, method.__self__)


_REGIONS = itertools.count()


def _own_code(method):
    """``method`` on a copy of its function with a code object of its own (named
    ``<name>_<n>``). The steady stance checks only the guards that tell one code object's
    cache entries apart; with a code object per region those are its own entries (the train
    / eval mode, the grad mode), never another layer's or another model's in this process,
    which it would otherwise have to tell apart by guards it skips."""
    fn = method.__func__
    n = next(_REGIONS)
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{n}", co_qualname=f"{fn.__qualname__}_{n}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return types.MethodType(own, method.__self__)


def _graphs_compiled() -> int:
    """Graphs TorchDynamo has compiled in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class SteadyGuards:
    """The guard stance of each training step (module docstring); ``enabled=False``: every
    guard, every step."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._steady_after: int | None = None  # the compile count a full-guard step ended at

    @contextlib.contextmanager
    def step(self):
        if not self.enabled:
            yield
            return
        if self.steady:
            import torch

            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                yield
            return
        compiled = _graphs_compiled()
        yield
        self._steady_after = compiled if _graphs_compiled() == compiled else None

    @property
    def steady(self) -> bool:
        """Whether the next step runs under the steady stance (nothing compiled since)."""
        return self.enabled and self._steady_after == _graphs_compiled()
