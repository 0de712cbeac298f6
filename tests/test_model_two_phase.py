"""The model's two-phase path (block store, phase 1 per segment, phase 2 per sublayer) against
the same model on the one-pass reference op: logits and every parameter gradient, for Block
sizes with uneven last blocks, Full AttnRes, both recompute modes, and stage cuts inside
blocks (a cut ends a segment; the payload is the store plus the partial block).
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.config import load_config
from attnres_dist.model.depth_mixing import FULL_GROUP, configure_segments
from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
from attnres_dist.ops.cpu_two_phase import requirement as cpu_kernel_requirement
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from attnres_dist.pipeline.contract import pack, unpack
from bench.saved_bytes import SavedTensorCounter
from tests.tiny_model import VOCAB, randomize_mixers, tiny_overrides

# the two-phase implementations runnable here (the fused CPU kernels need a C compiler)
FAST = ["twophase", *(["cpu_fused"] if cpu_kernel_requirement() is None else [])]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_distributed(ParallelDims(), seed=0)


def build(impl, mode="block", block_size=2, num_layers=3, recompute="none", interval=1):
    cfg = load_config(
        None, tiny_overrides(mode, block_size, num_layers, **{"model.attnres.impl": impl})
    )
    model = AttnResGPT(ModelBuilder(cfg.model, VOCAB, seed=0), recompute, interval)
    randomize_mixers(model)
    return model


def window(batch=2, seq=13):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def loss_and_grads(model, forward=None):
    w = window()
    logits = (forward or model)(w[:, :-1])
    from attnres_dist.model.embedding_head import lm_loss

    loss = lm_loss(logits, w[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b, tol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        e = grads_b[name]
        err = (grads_a[name] - e).abs().max() / e.abs().max().clamp_min(1e-12)
        assert err <= tol, (name, err.item())


CASES = [("block", 2, 3), ("block", 3, 3), ("block", 4, 3), ("block", 6, 3), ("full", 1, 3)]


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("mode, size, layers", [*CASES, ("full", 1, 6), ("block", 1, 5)])
def test_two_phase_model_matches_one_pass(impl, mode, size, layers):
    ref = loss_and_grads(build("reference", mode, size, layers))
    assert_same(loss_and_grads(build(impl, mode, size, layers)), ref)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("recompute, interval", [("attnres", 1), ("full", 1), ("full", 2)])
@pytest.mark.parametrize("mode, size", [("block", 3), ("full", 1)])
def test_two_phase_recompute_matches_one_pass(impl, recompute, interval, mode, size):
    ref = loss_and_grads(build("reference", mode, size, 4))
    assert_same(loss_and_grads(build(impl, mode, size, 4, recompute, interval)), ref)


def test_full_and_block_size_one_are_the_same_model():
    full, block = build("twophase", "full", 1, 5), build("twophase", "block", 1, 5)
    assert 2 * 5 > FULL_GROUP  # more than one phase-1 group
    block.load_state_dict(full.state_dict())
    assert torch.equal(full(window()[:, :-1]), block(window()[:, :-1]))


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("mode, size, cut", [("block", 3, 1), ("block", 4, 2), ("full", 1, 2)])
@pytest.mark.parametrize("receive", ["views", "adopted"])
def test_stage_cut_inside_a_segment(impl, mode, size, cut, receive):
    """Two 'stages' in one process: each configures its own segments; pack/unpack between.
    "adopted": the receiver copies the blocks into its store buffer (as a pipeline stage
    does), "views": it reads them in the payload."""
    model = build(impl, mode, size, 4)
    first, second = list(model.layers[:cut]), list(model.layers[cut:])
    configure_segments(first, model.plan)
    configure_segments(second, model.plan, final=model.final)
    capacity = second[0].store_capacity if receive == "adopted" else None
    payloads = []

    def forward(tokens):
        state = model.embedding(tokens)
        for layer in first:
            state = layer(state)
        payload = pack(state)
        payloads.append(payload)
        state = unpack(payload, model.plan, cut, "cut", capacity)
        assert (state.buffer is not None) == (receive == "adopted")
        for layer in second:
            state = layer(state)
        return model.embedding.logits(model.final(state))

    ref = loss_and_grads(build("reference", mode, size, 4))
    assert_same(loss_and_grads(model, forward), ref)
    assert payloads[0].shape[0] == model.plan.boundary_width(cut)


def test_store_grows_in_place_and_payload_shares_it():
    """Each block is copied once into the store's buffer; the payload is the same storage."""
    model = build("twophase", "block", 3, 4)  # 8 sublayers: blocks close after 3 and 6
    state = model.embedding(window()[:, :-1])
    stores = []
    for layer in model.layers[:3]:
        state = layer(state)
        stores.append(state.store)
    assert [s.shape[0] for s in stores] == [1, 2, 3]
    payload = pack(state)  # after 6 sublayers: b_0, two blocks and no partial
    ptr = payload.untyped_storage().data_ptr()
    assert stores[1].untyped_storage().data_ptr() == ptr == stores[2].untyped_storage().data_ptr()
    state = model.layers[3](state)  # sublayers 7, 8 close the last block
    assert state.store.untyped_storage().data_ptr() == ptr
    # an earlier store, saved by phase 1, still reads its own rows after later appends
    torch.testing.assert_close(stores[1], state.store[:2], atol=0, rtol=0)
    model.embedding.logits(model.final(state)).sum().backward()  # no version-counter error


def test_two_phase_saves_less_than_lean_for_backward():
    """The whole model's saved bytes: the store and phase 1 add no [S, n, tokens, D] tensors."""
    counts = {}
    for impl in ("lean", *FAST):
        model = build(impl, "block", 2, 4)
        with SavedTensorCounter() as counter:
            logits = model(window()[:, :-1])
        counts[impl] = counter.total_bytes()
        del logits
    for impl in FAST:
        assert counts[impl] <= 1.1 * counts["lean"], counts


def test_store_buffer_gradient_rows_are_written_by_their_first_writer():
    from attnres_dist.model.store_buffer import StoreBuffer

    buffer = StoreBuffer(torch.randn(4, 3))
    rows, accumulate = buffer.grad_rows(1, 3)  # nothing written yet: the caller writes
    assert not accumulate and rows.shape == (2, 3)
    rows.fill_(2.0)
    rows, accumulate = buffer.grad_rows(0, 2)  # row 1 holds a value: row 0 is zeroed, add
    assert accumulate
    assert rows.tolist() == [[0.0] * 3, [2.0] * 3]
    rows += 1.0
    assert buffer.grad(3)[:3].tolist() == [[1.0] * 3, [3.0] * 3, [2.0] * 3]
    assert buffer.grad()[3].tolist() == [0.0] * 3  # zeroed when asked for


@pytest.mark.skipif(cpu_kernel_requirement() is not None, reason="needs the C kernels")
@pytest.mark.parametrize("mode, size", [("block", 2), ("full", 1)])
def test_final_aggregation_writes_the_store_gradient_without_a_zero_fill(mode, size):
    """The final aggregation's phase 1 covers every store row and is the first to write their
    gradient, into the buffer: no fill and no copy of the buffer's size runs in backward, and
    the gradients still match."""
    from torch.profiler import ProfilerActivity, profile

    model = build("cpu_fused", mode, size, num_layers=3)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fast = loss_and_grads(model)
    writes = [
        (e.name, e.input_shapes[0])
        for e in prof.events()
        if e.name in ("aten::fill_", "aten::zero_", "aten::copy_")
        and e.input_shapes
        and e.input_shapes[0]
    ]
    rows = [w for w in writes if len(w[1]) == 4 and w[1][1:] == [12, 2, 32] and w[1][0] > 1]
    assert not rows, rows  # no fill or copy of store rows (a row is 12 x 2 x 32)
    assert_same(fast, loss_and_grads(build("reference", mode, size, num_layers=3)))


@pytest.mark.skipif(cpu_kernel_requirement() is not None, reason="needs the C kernels")
@pytest.mark.parametrize(
    "mode, size, recompute, calls",
    [
        ("block", 2, "none", 3),  # 3 blocks: 3 phase-1 passes, none for the final aggregation
        ("block", 4, "attnres", 2),  # blocks of 4 + 2 sublayers; merges recomputed, not phase 1
        ("full", 1, "none", 1),  # 6 sublayers: one group
        ("block", 2, "full", 7),  # 3 passes, again in each layer's recompute, the final's own
    ],
)
def test_final_aggregation_joins_the_last_segment(mode, size, recompute, calls):
    """The final aggregation's query rides on the last segment's phase 1 and merges the block
    closed after it (phase 2), where a phase 1 of its own would read every block once more;
    after a fully recomputed layer (no phase-1 results leave its group) it runs its own. The
    model still matches the one-pass reference."""
    from torch.profiler import ProfilerActivity, profile

    model = build("cpu_fused", mode, size, num_layers=3, recompute=recompute)
    assert (model.final.segment is None) == (recompute == "full")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fast = loss_and_grads(model)
    assert sum(e.name == "_Phase1" for e in prof.events()) == calls
    ref = build("reference", mode, size, num_layers=3, recompute=recompute)
    assert_same(fast, loss_and_grads(ref))


def build_with_runtime(impl, mode, size, recompute="none", fused_norm="on"):
    """``build`` with the runtime's norms: the C kernel's (``fused_norm=on``) or torch's."""
    from attnres_dist.runtime import select_runtime

    words = tiny_overrides(mode, size, 3, **{"model.attnres.impl": impl})
    cfg = load_config(None, [*words, f"runtime.fused_norm={fused_norm}"])
    runtime = select_runtime(cfg.runtime)
    model = AttnResGPT(ModelBuilder(cfg.model, VOCAB, seed=0, runtime=runtime), recompute)
    randomize_mixers(model)
    gen = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        if "layernorm" in name:  # gains away from 1, so a norm's gain gradient counts
            p.data.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.skipif(cpu_kernel_requirement() is not None, reason="needs the C kernels")
@pytest.mark.parametrize(
    "mode, size, recompute, blocks",
    [("block", 2, "none", 3), ("block", 3, "none", 2), ("full", 1, "none", 1),
     ("block", 2, "full", 3), ("block", 2, "attnres", 0)],
)  # fmt: skip
def test_phase1_applies_the_first_sublayers_norm(mode, size, recompute, blocks):
    """A segment's first sublayer merges nothing, so phase 1 hands it its normalised input (the
    layer's C RMSNorm applied in the same kernel pass): the layers' norms then run nowhere on
    their own (the other sublayers' norms are fused with their merge), except under attnres
    recompute, where the norm belongs to the recomputed region. Loss and every gradient match
    the model on the one-pass reference op with torch's norms, same weights."""
    from attnres_dist.ops.cpu_rms_norm import CpuRMSNorm

    model = build_with_runtime("cpu_fused", mode, size, recompute)
    segments = {id(s): s for layer in model.layers for s in layer.segments.values()}
    assert sum(s.first_norm is not None for s in segments.values()) == blocks
    calls = []
    for layer in model.layers:
        for norm in (layer.layer.input_layernorm, layer.layer.pre_mlp_layernorm):
            assert isinstance(norm, CpuRMSNorm)
            norm.register_forward_hook(lambda *_: calls.append(1))
    fast = loss_and_grads(model)
    if recompute == "none":
        assert not calls  # every layer norm ran inside phase 1 or a fused merge
    ref = build_with_runtime("reference", mode, size, recompute, fused_norm="off")
    ref.load_state_dict(model.state_dict())
    assert_same(fast, loss_and_grads(ref))


@pytest.mark.parametrize("size", [2, 3])
def test_a_closing_block_is_summed_into_its_store_row(size):
    """Closing a Block block writes ``partial + out`` straight into the store's row: the
    layers' forward adds into the buffer (``out=``) and copies no row-sized tensor there, the
    store holds the sums of the sublayer outputs (checked against outputs recorded with hooks)
    and the model still matches the one-pass reference."""
    from torch.profiler import ProfilerActivity, profile

    model = build("twophase", "block", size, 3)
    outputs = []  # v_1 .. v_6, every sublayer's raw output in order
    for layer in model.layers:
        for sub in (layer.layer.self_attention, layer.layer.mlp):
            sub.register_forward_hook(lambda m, i, o: outputs.append(o[0].detach()))
    state = model.embedding(window()[:, :-1])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for layer in model.layers:
            state = layer(state)
    row = [12, 2, 32]
    copies = [e for e in prof.events() if e.name == "aten::copy_" and row in e.input_shapes]
    assert not copies, [e.input_shapes for e in copies]
    blocks = [sum(outputs[i : i + size]) for i in range(0, 6, size)]
    for c, block in enumerate(blocks, start=1):
        torch.testing.assert_close(state.store[c], block, atol=1e-6, rtol=1e-6)
    assert_same(loss_and_grads(build("twophase", "block", size, 3)),
                loss_and_grads(build("reference", "block", size, 3)))  # fmt: skip
