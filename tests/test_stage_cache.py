"""The cross-stage cache against one whole-graph model, on one process.

A chain of C chunks built from the real model parts (``ModelBuilder``, tiny shapes) runs one
rank's boundary object per virtual rank, in the pass order of the real schedules (DeepSpeed's
``DualPipeVSchedule``, the project's interleaved one, executed by ``schedule_sim``): forwards
chunk by chunk, backwards in reverse, micro-batches interleaved, every chunk's autograd graph
its own (a payload crossing ranks is cloned into a fresh leaf, as p2p does; the V's turn hands
a detached leaf over, as DeepSpeed's ``DualPipeVEngine`` does). The naive contract and the
cache must both reproduce the whole-graph reference (``AttnResGPT`` with the same weights):
hidden states, losses and every parameter gradient; the cache sends the plan's payloads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from attnres_dist.config import load_config
from attnres_dist.model.depth_state import DepthState
from attnres_dist.model.embedding_head import lm_loss
from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
from attnres_dist.model.layer_runs import apply_runs
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from attnres_dist.pipeline.chunk_boundary import NaiveBoundary
from attnres_dist.pipeline.interleaved_schedule import InterleavedSchedule
from attnres_dist.pipeline.schedule_sim import simulate
from attnres_dist.pipeline.stage_cache import CachedBoundary, CacheLeakError
from attnres_dist.pipeline.stage_cache_plan import CachePlan
from attnres_dist.pipeline.virtual_layout import build_layout

VOCAB, S, B, H = 61, 8, 2, 16


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_distributed(ParallelDims(), seed=0)


def naive(plan: CachePlan, rank: int) -> NaiveBoundary:
    return NaiveBoundary(plan.layout, plan.block_plan)


def model_config(num_layers, mode, block_size, tie=True):
    return load_config(
        None,
        [
            f"model.num_layers={num_layers}",
            f"model.hidden_size={H}",
            "model.num_attention_heads=2",
            f"model.seq_length={S}",
            f"model.attnres.mode={mode}",
            f"model.attnres.block_size={block_size}",
            f"model.tie_embeddings={str(tie).lower()}",
        ],
    ).model


@dataclass
class Chain:
    """The model's parts cut into the layout's chunks, on one process."""

    builder: ModelBuilder
    layout: object
    modules: dict = field(default_factory=dict)

    def __post_init__(self):
        b, n = self.builder, self.builder.model.num_layers
        self.modules["embedding"] = b.embedding()
        for i in range(n):
            self.modules[f"layers.{i}"] = b.layer(i)
        self.modules["final"] = b.final()
        if not b.model.tie_embeddings:
            self.modules["output"] = b.output()
        for c in range(self.layout.C):  # as the pipeline module configures its local layers
            local = [self.modules[f"layers.{i}"] for i in self.layout.layers_of(c)]
            apply_runs(local, b.plan)

    def run(self, chunk, x, tokens, labels, hidden_out):
        n = self.builder.model.num_layers
        for idx in range(self.layout.parts[chunk], self.layout.parts[chunk + 1]):
            if idx == 0:
                x = self.modules["embedding"](tokens)
            elif idx <= n:
                x = self.modules[f"layers.{idx - 1}"](x)
            elif idx == n + 1:
                x = self.modules["final"](x)
                hidden_out.append(x.detach())
            elif "output" in self.modules:
                x = lm_loss(self.modules["output"](x), labels)
            else:
                x = lm_loss(self.modules["embedding"].logits(x), labels)
        return x

    def grads(self):
        return {
            f"{m}.{p}": q.grad for m, mod in self.modules.items() for p, q in mod.named_parameters()
        }


def schedule_order(layout, M):
    """One global pass order: the simulated schedule's passes by start time."""
    P, V = layout.P, layout.V
    if layout.placement == "vshape":
        scheds = [ds.DualPipeVSchedule(M, P, r) for r in range(P)]
    else:
        scheds = [InterleavedSchedule(M, P, r, V) for r in range(P)]
    result = simulate(scheds, layout.chunk_at, layout.C, M, 1, 2)
    passes = sorted(result.blocking, key=lambda i: (i.start, i.end, i.rank))
    return [(i.forward, i.chunk, i.micro_batch) for i in passes], result.orders


def run_chain(chain, plan, boundary_cls, batches, order, grad=True):
    """Run the passes; returns (losses, hidden states, sent shapes per transition, boundaries)."""
    lay, M = chain.layout, len(batches)
    bnd = [boundary_cls(plan, r) for r in range(lay.P)]
    inputs, outputs, losses, hidden, sent = {}, {}, {}, {}, {}
    for forward, c, mb in order:
        if not grad and not forward:
            continue
        b = bnd[lay.rank_of(c)]
        tokens, labels = batches[mb][:, :-1], batches[mb][:, 1:]
        if forward:
            with torch.set_grad_enabled(grad):
                x = tokens
                if c > 0:
                    x = inputs[(c, mb)]
                    if not lay.starts_with_head(c):
                        x = b.receive(c, mb, x)
                out = chain.run(c, x, tokens, labels, hidden.setdefault(mb, []))
                if c == lay.C - 1:
                    losses[mb] = out.detach()
                    outputs[(c, mb)] = out / M
                    continue
                if isinstance(out, DepthState):
                    out = b.send(c, mb, out)
                outputs[(c, mb)] = out
                sent.setdefault(c, set()).add(tuple(out.shape))
                handed = out.detach() if lay.is_local(c) else out.detach().clone()
                inputs[(c + 1, mb)] = handed.requires_grad_(grad)
            if not grad:
                outputs.pop((c, mb))
        else:
            out = outputs.pop((c, mb))
            g = torch.ones_like(out) if c == lay.C - 1 else inputs.pop((c + 1, mb)).grad
            if c < lay.C - 1 and not lay.is_local(c):
                g = g.clone()  # the gradient crosses ranks
            extra_t, extra_g = b.backward_extras(c, mb)
            torch.autograd.backward([out, *extra_t], [g, *extra_g])
            b.after_backward(c, mb)
    for b in bnd:
        b.check_empty()
    return losses, hidden, sent, bnd


def reference(builder, batches):
    ref = AttnResGPT(builder)
    losses, hidden = {}, {}
    total = 0
    for mb, window in enumerate(batches):
        tokens, labels = window[:, :-1], window[:, 1:]
        hidden[mb] = ref.hidden_states(tokens)
        logits = ref.embedding.logits(hidden[mb]) if ref.tie_embeddings else ref.output(hidden[mb])
        losses[mb] = lm_loss(logits, labels)
        total = total + losses[mb] / len(batches)
    total.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    return losses, hidden, grads


CASES = [
    # (num_layers, mode, block size, P, V, placement, partition, tied)
    (4, "full", 1, 2, 2, "looped", "uniform", True),
    (6, "block", 3, 2, 3, "looped", "uniform", True),  # blocks close inside chunks, partials cross
    (7, "block", 3, 3, 2, "looped", [1, 2, 1, 1, 1, 1], False),
    (5, "block", 3, 2, 2, "vshape", [2, 1, 1, 1], True),
    (4, "full", 1, 2, 2, "vshape", "uniform", False),
    (6, "block", 5, 3, 2, "vshape", "uniform", True),
]


def setup(case, keep_produced=True, M=None):
    n, mode, size, P, V, placement, partition, tied = case
    m = model_config(n, mode, size, tied)
    layout = build_layout(m, P, V, placement, partition, VOCAB)
    plan = CachePlan(layout, m.block_plan(), S, B, H, keep_produced=keep_produced)
    M = M or 2 * P
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (B, S + 1), generator=gen) for _ in range(M)]
    return m, layout, plan, batches


def close(a, b, tol=1e-6):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("keep_produced", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}{c[2]}-P{c[3]}V{c[4]}-{c[5]}")
def test_cache_and_naive_reproduce_the_whole_graph(case, keep_produced):
    m, layout, plan, batches = setup(case, keep_produced)
    ref_losses, ref_hidden, ref_grads = reference(ModelBuilder(m, VOCAB, seed=3), batches)
    order, orders = schedule_order(layout, len(batches))
    for kind in (naive, CachedBoundary) if keep_produced else (CachedBoundary,):
        chain = Chain(ModelBuilder(m, VOCAB, seed=3), layout)
        losses, hidden, sent, bnd = run_chain(chain, plan, kind, batches, order)
        for mb in ref_losses:
            assert close(losses[mb], ref_losses[mb]), (kind.__name__, mb)
            assert close(hidden[mb][0], ref_hidden[mb].detach()), (kind.__name__, mb)
        grads = chain.grads()
        assert set(grads) == set(ref_grads)
        for name, g in ref_grads.items():
            assert grads[name] is not None, name
            assert close(grads[name], g), (kind.__name__, name, (grads[name] - g).abs().max())
        cached = kind is CachedBoundary
        for t in plan.transitions:  # every payload has the plan's static shape
            if t.kind != "local":
                assert sent[t.src_chunk] == {t.shape(cached)}, t.name
        if cached:  # the measured peak is the plan's prediction for this order
            assert [b.peak_entries for b in bnd] == plan.peak_cache(orders)
            assert all(b.live_entries == 0 for b in bnd)


@pytest.mark.parametrize("case", CASES[1:4], ids=lambda c: f"{c[1]}{c[2]}-P{c[3]}-{c[5]}")
def test_cached_payloads_are_smaller_than_naive(case):
    _, layout, plan, _ = setup(case)
    sent = [t for t in plan.transitions if t.kind == "blocks"]
    assert sum(t.nbytes(True) for t in sent) < sum(t.nbytes(False) for t in sent)
    assert all(t.nbytes(True) <= t.nbytes(False) for t in sent)
    assert plan.bytes_per_micro_batch(True) < plan.bytes_per_micro_batch(False)


def test_eval_frees_every_entry_and_matches():
    case = CASES[2]
    m, layout, plan, batches = setup(case)
    ref_losses, ref_hidden, _ = reference(ModelBuilder(m, VOCAB, seed=3), batches)
    order, _ = schedule_order(layout, len(batches))
    chain = Chain(ModelBuilder(m, VOCAB, seed=3), layout)
    losses, hidden, _, bnd = run_chain(chain, plan, CachedBoundary, batches, order, grad=False)
    for mb in ref_losses:
        assert close(losses[mb], ref_losses[mb].detach())
    assert all(b.live_entries == 0 for b in bnd) and any(b.peak_entries > 0 for b in bnd)


def test_leaks_and_misuse_are_caught():
    case = CASES[1]
    m, layout, plan, batches = setup(case)
    chain = Chain(ModelBuilder(m, VOCAB, seed=3), layout)
    order, _ = schedule_order(layout, len(batches))
    forwards = [op for op in order if op[0]]
    with pytest.raises(CacheLeakError, match="is not empty: micro-batch 0 block 0"):
        run_chain(chain, plan, CachedBoundary, batches, forwards)  # no backward ran
    # a backward that skips the stashed gradients is refused when its entries are freed
    b = CachedBoundary(plan, 0)
    owner = min(e.source_chunk for e in b.entries.values())
    b._stash[(0, 0)] = torch.zeros(S, B, H)
    with pytest.raises(CacheLeakError, match="backward_extras was not propagated"):
        b.after_backward(owner, 0)
    # a payload of the naive width where the cache sends fewer blocks names the boundary
    t = next(t for t in plan.transitions if t.kind == "blocks" and t.cached_k < t.naive_k)
    with pytest.raises(RuntimeError, match=f"boundary into chunk {t.dst_chunk} on rank"):
        CachedBoundary(plan, t.dst_rank).receive(t.dst_chunk, 0, torch.zeros(t.shape(False)))
