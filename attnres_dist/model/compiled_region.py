"""How a part of the model becomes one ``torch.compile`` region (``runtime.compile: layer``).

Each transformer layer's two sublayers (``AttnResLayer.sublayers``) and the final aggregation
with its norm (``FinalAggregation.aggregate``) are compiled this way: ``fullgraph`` (a graph
break is an error, never a silent split) and static shapes (each layer is its own graph anyway:
its block structure is Python control flow, so dynamic shapes would only add guards). Every
layer's region shares one code object, whose cache then holds an entry per layer and mode
(train, eval): the recompile limit is raised to that. Inductor draws dropout masks from torch's
generator as eager does (``fallback_random``), so the layout-independent streams
(``model/dropout_streams.py``) and the eager reference see the same masks.

``cuda_graphs``: inductor's ``triton.cudagraphs`` (what mode ``reduce-overhead`` sets; a mode
and options cannot be given together): each region's forward and backward replay as CUDA graph
trees, which share one memory pool, keep a graph per live-tensor path (several micro-batches in
flight, recompute) and read dropout's Philox seed and offset from the generator at replay, so
re-seeding the streams before a replay holds. The engines mark each step's start
(``torch.compiler.cudagraph_mark_step_begin``).
"""

from __future__ import annotations


def compile_region(fn, num_layers: int, backend: str = "inductor", cuda_graphs: bool = False):
    """``fn`` as one compiled region of a model with ``num_layers`` layers."""
    import torch._dynamo  # only where something is compiled

    entries = 2 * num_layers + 8  # train and eval per layer, and a margin
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, entries)
    options = {"fallback_random": True} if backend == "inductor" else None
    if cuda_graphs:
        options = {**(options or {}), "triton.cudagraphs": True}
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=options)
