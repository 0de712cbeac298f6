"""SDPA core attention (attnres_dist.model.sdpa_attention) against Megatron's DotProductAttention.

Megatron's own module is the independent reference: the same constructor arguments build
both, the same q/k/v go in, outputs and gradients must agree (fp32 <= 1e-5), with and without
grouped-query attention, for no mask (the causal fast path), the causal mask given explicitly
and a non-causal mask. The whole model built with either core attention must give the same loss and
gradients. Dropout is checked for what it must do (keep or zero each attention weight, scale
kept ones by 1/(1-p), about p of them zeroed, draws from the model-parallel RNG tracker) and for
what it must not (any randomness in eval mode).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from attnres_dist import megatron_compat
from attnres_dist.config import ModelConfig
from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
from attnres_dist.model.megatron_config import transformer_config
from attnres_dist.model.sdpa_attention import SdpaAttention, SdpaSelfAttention
from attnres_dist.model.sequence_context import sequence_context
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from attnres_dist.runtime import Choice, RuntimeChoice

TOL = 1e-5
VOCAB = 257


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_distributed(ParallelDims(), seed=0)  # Megatron's (1-rank) groups and the RNG tracker


def pair(heads=4, groups=None, hidden=64, dropout=0.0, seq=16):
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        seq_length=seq,
        attention_dropout=dropout,
    )
    config = transformer_config(cfg)
    kwargs = dict(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        softmax_scale=None,
    )
    return DotProductAttention(**kwargs), SdpaAttention(**kwargs), config


def qkv(seq, batch, heads, groups, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(seq, batch, heads, head_dim)] + 2 * [(seq, batch, groups, head_dim)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def run(module, tensors, mask, grad):
    out = module(*tensors, mask)
    grads = torch.autograd.grad(out, tensors, grad)
    return out.detach(), grads


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("heads, groups", [(4, None), (4, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("mask_kind", ["causal", "random", "none"])
def test_sdpa_matches_dot_product_attention(heads, groups, mask_kind, monkeypatch):
    megatron, sdpa, config = pair(heads, groups)
    seq, batch, head_dim = 16, 3, config.kv_channels
    tensors = qkv(seq, batch, heads, groups or heads, head_dim)
    causal = sequence_context(config, tensors[0], 10000).attention_mask
    if mask_kind == "causal":
        mask = causal  # given, it is read: the explicit-mask path
    elif mask_kind == "random":
        g = torch.Generator().manual_seed(5)
        mask = torch.rand(1, 1, seq, seq, generator=g) < 0.4
        mask[..., 0] = False  # no row fully masked (Megatron's fill and SDPA differ there)
    else:
        # no mask: Megatron builds its default causal mask (on CUDA: given here on the CPU)
        mask = None
        import megatron.core.fusions.fused_softmax as fused_softmax

        monkeypatch.setattr(fused_softmax, "get_default_causal_mask", lambda sq: causal[0, 0])
    grad = torch.randn(seq, batch, heads * head_dim, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = run(megatron, tensors, mask, grad)
    out, grads = run(sdpa, tensors, mask, grad)
    assert out.shape == ref_out.shape == (seq, batch, heads * head_dim)
    assert (out - ref_out).abs().max().item() <= TOL
    assert max_diff(grads, ref_grads) <= TOL


def test_query_key_layer_scaling_and_explicit_softmax_scale_match():
    for extra in ({"apply_query_key_layer_scaling": True}, {"softmax_scale": 0.3}):
        cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8)
        config = transformer_config(cfg)
        for key, value in extra.items():
            setattr(config, key, value)
        kwargs = dict(
            config=config,
            layer_number=3,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            softmax_scale=config.softmax_scale,
        )
        megatron, sdpa = DotProductAttention(**kwargs), SdpaAttention(**kwargs)
        tensors = qkv(8, 2, 4, 4, 8, seed=3)
        mask = sequence_context(config, tensors[0], 10000).attention_mask
        grad = torch.randn(8, 2, 32)
        ref_out, ref_grads = run(megatron, tensors, mask, grad)
        out, grads = run(sdpa, tensors, mask, grad)
        assert (out - ref_out).abs().max().item() <= TOL, extra
        assert max_diff(grads, ref_grads) <= TOL, extra


def _choice(core_attention: str) -> RuntimeChoice:
    values = ("cpu", "local", "torch", "torch", "fp32", core_attention)
    return RuntimeChoice(*[Choice(v, "test") for v in values])


@pytest.mark.parametrize(
    "mode, groups", [("block", None), ("full", 2), ("baseline", None)], ids=str
)
def test_whole_model_forward_backward_megatron_vs_sdpa(mode, groups):
    cfg = ModelConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=groups,
        seq_length=12,
    )
    cfg.attnres.mode = mode
    cfg.attnres.block_size = 3
    window = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    results = {}
    for kind in ("megatron", "sdpa"):
        model = AttnResGPT(ModelBuilder(cfg, VOCAB, seed=4, runtime=_choice(kind)))
        attention = model.layers[0].layer.self_attention.core_attention
        assert type(attention) is (SdpaAttention if kind == "sdpa" else DotProductAttention)
        block = model.layers[0].layer.self_attention
        assert isinstance(block, SdpaSelfAttention) == (kind == "sdpa")
        with torch.no_grad():  # AttnRes queries start at zero: make the depth mix non-uniform
            for name, p in model.named_parameters():
                if name.endswith("mixer_weights"):  # [mixers, (query, key gain), D]
                    p[:, 0].normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
        loss = model.loss(window)
        loss.backward()
        results[kind] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss_m, grads_m), (loss_s, grads_s) = results["megatron"], results["sdpa"]
    assert grads_m.keys() == grads_s.keys()
    assert abs(loss_m - loss_s) <= TOL
    assert max_diff(grads_m.values(), grads_s.values()) <= TOL


# ------------------------------------------------------------------------- rotary embedding


@pytest.mark.parametrize("interleaved", [False, True], ids=["tables", "interleaved-fallback"])
def test_self_attention_rotary_tables_match_megatrons_rope(interleaved, monkeypatch):
    from megatron.core.transformer.spec_utils import build_module

    from attnres_dist.model import layer_specs
    from attnres_dist.model.gpt import seeded

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=12)
    config = transformer_config(cfg)
    config.rotary_interleaved = interleaved
    blocks = {}
    for kind in ("megatron", "sdpa"):
        spec = layer_specs.layer_spec(_choice(kind)).submodules.self_attention
        with seeded(0, "attention"):
            blocks[kind] = build_module(spec, config=config, layer_number=1)
    assert type(blocks["sdpa"]) is SdpaSelfAttention
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 2, 32, generator=g).requires_grad_()
    ctx = sequence_context(config, x, 10000)
    grad = torch.randn(12, 2, 32, generator=g)
    rotated = []  # the table path marks its q/k tensors; Megatron's path must not be taken
    original = SdpaSelfAttention.get_query_key_value_tensors

    def spy(self, *args, **kwargs):
        rotated.append(self._rope is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SdpaSelfAttention, "get_query_key_value_tensors", spy)
    results = {}
    for kind, block in blocks.items():
        out, _ = block(x, attention_mask=ctx.attention_mask, rotary_pos_emb=ctx.rotary_pos_emb)
        grads = torch.autograd.grad(out, [x, *block.parameters()], grad)
        results[kind] = (out.detach(), grads)
    assert rotated == [not interleaved]
    assert (results["sdpa"][0] - results["megatron"][0]).abs().max().item() <= TOL
    assert max_diff(results["sdpa"][1], results["megatron"][1]) <= TOL


# ---------------------------------------------------------------------------------- dropout


def _one_hot_values(seq, batch, heads, head_dim):
    """q, k random; v = one-hot of the key position, so output[..., j] = weight of key j."""
    q, k, _ = qkv(seq, batch, heads, heads, head_dim, seed=7)
    eye = torch.eye(seq, head_dim)  # head_dim >= seq
    v = eye[:, None, None, :].expand(seq, batch, heads, head_dim).contiguous().requires_grad_()
    return [q, k, v]


@pytest.mark.parametrize("cls", [DotProductAttention, SdpaAttention], ids=lambda c: c.__name__)
def test_attention_dropout_keeps_or_zeroes_each_weight(cls):
    p, seq, batch, heads = 0.3, 16, 8, 4
    megatron, sdpa, config = pair(heads, hidden=heads * 16, dropout=p, seq=seq)
    module = megatron if cls is DotProductAttention else sdpa
    tensors = _one_hot_values(seq, batch, heads, 16)
    mask = sequence_context(config, tensors[0], 10000).attention_mask
    module.eval()
    with torch.no_grad():
        weights = module(*tensors, mask).view(seq, batch, heads, 16)
        again = module(*tensors, mask).view(seq, batch, heads, 16)
    assert torch.equal(weights, again)  # eval: deterministic, no dropout
    module.train()
    with torch.no_grad():
        dropped = module(*tensors, mask).view(seq, batch, heads, 16)
    live = weights > 1e-6  # the causal, non-negligible weights
    kept = dropped[live] != 0
    scaled = dropped[live][kept] / weights[live][kept]
    torch.testing.assert_close(scaled, torch.full_like(scaled, 1 / (1 - p)), atol=1e-4, rtol=1e-4)
    assert (dropped[~live].abs() <= 1e-5 / (1 - p)).all()  # masked weights stay (near) zero
    n = live.sum().item()
    zeroed = 1 - kept.float().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(zeroed - p) < 5 * sigma, (zeroed, p, n)  # n ~ 4000 weights: sigma ~ 0.007


@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_dropout_stream_replays_and_eval_equals_megatron(tp):
    """At tp = 1 the masks come from the default generator (what a compiled layer traces); under
    tensor parallelism from the model-parallel tracker's fork, so each rank draws its own heads'.
    Either way, restoring the stream replays the same masks, as recompute does."""
    from megatron.core import tensor_parallel

    megatron_compat.seed_model_parallel_rng(11)
    megatron, sdpa, config = pair(4, dropout=0.5)
    config.tensor_model_parallel_size = tp  # after construction: the shapes stay one rank's
    tensors = qkv(16, 2, 4, 4, 16, seed=2)
    mask = sequence_context(config, tensors[0], 10000).attention_mask
    tracker = tensor_parallel.get_cuda_rng_tracker()
    sdpa.train()
    before_default = torch.get_rng_state()
    before_tracker = tracker.get_states()
    with torch.no_grad():
        first = sdpa(*tensors, mask)
    default_moved = not torch.equal(torch.get_rng_state(), before_default)
    tracker_moved = any(
        not torch.equal(before_tracker[k], v) for k, v in tracker.get_states().items()
    )
    assert (default_moved, tracker_moved) == ((True, False) if tp == 1 else (False, True))
    torch.set_rng_state(before_default), tracker.set_states(before_tracker)
    with torch.no_grad():
        replay = sdpa(*tensors, mask)
        other = sdpa(*tensors, mask)
    assert torch.equal(first, replay)
    assert not torch.equal(first, other)
    config.tensor_model_parallel_size = 1
    megatron.eval(), sdpa.eval()
    with torch.no_grad():
        ref = megatron(*tensors, mask)
        out = sdpa(*tensors, mask)
    assert (out - ref).abs().max().item() <= TOL


def test_rotary_tables_made_once_per_length_and_dtype():
    """The sequence context makes the tables once per (length, dtype, scale) and every layer
    and step reads them: the same tensors on the next call, others for another dtype, each
    equal to the naive cos and signed sin of the angles (times the scale) rounded to that
    dtype; the attention built by the layer spec asks for them at its scale."""
    from megatron.core.transformer.spec_utils import build_module

    from attnres_dist.model import layer_specs

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=12)
    config = transformer_config(cfg)
    spec = layer_specs.layer_spec(_choice("sdpa")).submodules.self_attention
    block = build_module(spec, config=config, layer_number=1)
    assert block.takes_tables and block.mscale == 1.0
    freqs = sequence_context(config, torch.zeros(12, 1, 32), 10000).rotary_pos_emb
    half = freqs.shape[-1] // 2
    made = {}
    for dtype in (torch.float32, torch.bfloat16):
        like = torch.zeros(12, 1, 32, dtype=dtype)
        tables = sequence_context(config, like, 10000, mscale=0.5).tables
        again = sequence_context(config, like, 10000, mscale=0.5).tables
        assert again is tables
        assert tables.cos.dtype == tables.sin.dtype == dtype
        assert torch.equal(tables.cos, (freqs.cos() * 0.5).to(dtype))
        signed = torch.cat([-freqs[..., :half].sin(), freqs[..., half:].sin()], dim=-1)
        assert torch.equal(tables.sin, (signed * 0.5).to(dtype))
        made[dtype] = tables
    assert made[torch.float32].cos is not made[torch.bfloat16].cos
    assert sequence_context(config, torch.zeros(12, 1, 32), 10000).tables is None
