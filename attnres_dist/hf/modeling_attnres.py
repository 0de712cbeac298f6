"""Hugging Face ``transformers`` model of an AttnRes Transformer (baseline, Full, Block, Delta).

Shipped inside every ``attnres-dist export --format hf`` directory (``auto_map`` in its
``config.json`` points here), so ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` loads it; it depends on torch and transformers only.

It computes what the trainer's single-process model computes (arXiv 2603.15031):

* Layers: Llama-style names, Megatron-Core's math. RMSNorm with ``rms_norm_eps``; attention
  with grouped query heads (head ``h`` reads key/value group ``h // (heads / groups)``: the
  exporter de-interleaves Megatron's per-group ``[q..., k, v]`` fused weight into ``q_proj``,
  ``k_proj``, ``v_proj``); rotary embedding on every channel, non-interleaved halves
  (``rotate_half``, Megatron's default), after each head's query and key RMSNorm where
  ``qk_norm`` (Qwen3's; Megatron's ``qk_layernorm``), ``inv_freq = 1 / theta^(2i/d)``; SwiGLU
  ``down(silu(gate(x)) * up(x))`` (Megatron's ``linear_fc1`` rows are ``[gate; up]``); no
  biases. Mixture-of-experts layers (``moe_layers``): Megatron-Core's ``MoELayer`` as
  ``AttnResMoE`` (top-k routing, softmax over the chosen logits, SwiGLU experts, a shared
  expert), dropless.
* Depth attention (DESIGN section 2): the input of every sublayer is a softmax mix over the
  sources (Full: every earlier sublayer output and the embedding; Block: completed block sums
  plus the partial block), keys ``RMSNorm(s_j) * g`` (eps ``depth_attention_eps``), logits
  ``<w, k_j>``, values the raw sources, in fp32. The sublayer output ``f(x) = Sub(Norm(x))`` is
  added to the partial block, which closes every ``attnres_block_size`` sublayers (the last
  block may be shorter). Before the final norm one more mix reads every block. Baseline is the
  plain PreNorm residual.
* Delta AttnRes (``delta_full``, ``delta_block``; arXiv 2605.18855): the same sources less the
  partial block, and the mix is added to the residual stream ``h~`` (the sum of every block,
  partial included) instead of replacing it: the sublayer reads ``Norm(h~ + mix)``; the final
  norm reads ``h~`` (no final mix).
* Logits cover ``config.vocab_size`` (the tokenizer's ids): the rows the trainer added to pad
  the embedding matrix (``padded_vocab_size``) are sliced off, so no tool can emit them.

Caching: only self-attention keys and values depend on earlier positions; the depth-attention
state is per token and is rebuilt inside every forward, so a transformers ``Cache``
(``DynamicCache`` by default) holds exactly what a Llama cache holds. Positions follow the
cache length (or ``position_ids``); past ``max_position_embeddings`` (the trained window) RoPE
positions simply keep counting.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_attnres import AttnResConfig


class AttnResRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class AttnResDepthMixer(nn.Module):
    """Softmax attention over depth with one learned pseudo-query and a key RMSNorm gain."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack([s.float() for s in sources])  # [n, b, s, d]
        rms = torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        keys = values * rms * self.key_norm_weight.float()
        weights = torch.softmax((keys * self.query.float()).sum(dim=-1), dim=0)
        return (weights.unsqueeze(-1) * values).sum(dim=0).to(sources[0].dtype)


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3's RoPE frequencies: wavelengths past 8192 / 1 positions slowed by ``factor``,
    those under 8192 / 4 kept, the band between interpolated smoothly."""
    low, high, original = 1.0, 4.0, 8192
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(middle, blended, out)


def rotary_cos_sin(config: AttnResConfig, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin ``[b, s, head_dim]`` for positions ``[b, s]`` (Megatron's RotaryEmbedding)."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    if getattr(config, "rope_llama3_factor", None):
        inv_freq = llama3_scaled(inv_freq, config.rope_llama3_factor)
    freqs = position_ids.float()[..., None] * inv_freq  # [b, s, dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class AttnResAttention(nn.Module):
    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, q, kv = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        if config.qk_norm:  # each head's query and key normed before RoPE (Qwen3's)
            self.q_norm = AttnResRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = AttnResRMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x, cos, sin, mask, cache: Cache | None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.num_kv_heads != self.num_heads:
            repeat = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class AttnResMLP(nn.Module):
    def __init__(self, config: AttnResConfig, width: int | None = None):
        super().__init__()
        h, f = config.hidden_size, width or config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "model": None}


class AttnResMoE(nn.Module):
    """A mixture-of-experts MLP: each token goes to its top-k experts by the router's logits,
    weighted by the softmax over the chosen logits (Mixtral's routing, Megatron-Core's
    default) or, with ``router_pre_softmax`` and always at top-1, by each one's softmax over
    all logits (Switch Transformer's), plus the shared expert if there is one. Dropless."""

    def __init__(self, config: AttnResConfig):
        super().__init__()
        self.top_k, self.dtype = config.num_experts_per_tok, ROUTER_DTYPES[config.router_dtype]
        self.pre_softmax = config.router_pre_softmax or self.top_k == 1
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        width = config.moe_intermediate_size
        self.experts = nn.ModuleList(AttnResMLP(config, width) for _ in range(config.num_experts))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = AttnResMLP(config, shared) if shared else None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        dtype = self.dtype or flat.dtype
        logits = F.linear(flat.to(dtype), self.gate.weight.to(dtype))
        if self.pre_softmax:  # each chosen expert's softmax over all logits
            weights, chosen = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        else:
            top, chosen = logits.topk(self.top_k, dim=-1)
            weights = top.softmax(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                scaled = expert(flat[token]) * weights[token, slot, None].to(flat.dtype)
                out.index_add_(0, token, scaled)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view_as(x)


def block_size(config: AttnResConfig) -> int:
    """Sublayers per block (Full and Delta Full: 1)."""
    return 1 if config.attnres_mode in ("full", "delta_full") else config.attnres_block_size


def closes_block(config: AttnResConfig, sublayer: int) -> bool:
    """Whether sublayer ``sublayer`` (1-based; 2i+1 attention, 2i+2 MLP) ends its block."""
    return sublayer % block_size(config) == 0 or sublayer == 2 * config.num_hidden_layers


def norm_eps(config: AttnResConfig, sublayer: int | None) -> float:
    """The epsilon of the norm after the depth mix of ``sublayer`` (1-based; None: the final
    one): ``rms_norm_eps``, under ``attnres_source_scaled_eps`` times the square of what a
    zero-query mix of ``n`` sources scales the residual stream by: ``1 / n`` (Full: every
    earlier output and the embedding; Block: the embedding, the completed blocks and, inside
    a block, the partial one), Delta ``1 + 1 / n`` (the completed blocks; its final norm reads
    the stream itself)."""
    eps = config.rms_norm_eps
    mode = config.attnres_mode
    delta = mode.startswith("delta_")
    if mode == "baseline" or not config.attnres_source_scaled_eps or (delta and sublayer is None):
        return eps
    size = block_size(config)
    total = 2 * config.num_hidden_layers
    if sublayer is None:
        n = 1 + -(-total // size)
    else:
        partial = (sublayer - 1) % size > 0 and not delta
        n = 1 + (sublayer - 1) // size + int(partial)
    return eps * (n + 1) ** 2 / n**2 if delta else eps / (n * n)


class AttnResDecoderLayer(nn.Module):
    """Transformer layer ``layer_idx`` acting on the depth state ``(completed, partial)``."""

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        self.baseline = config.attnres_mode == "baseline"
        self.delta = config.attnres_mode.startswith("delta_")
        first = 2 * layer_idx + 1  # this layer's sublayers: attention, then MLP
        self.closes = (closes_block(config, first), closes_block(config, first + 1))
        self.layer_idx = layer_idx
        self.input_layernorm = AttnResRMSNorm(config.hidden_size, norm_eps(config, first))
        self.self_attn = AttnResAttention(config, layer_idx)
        self.post_attention_layernorm = AttnResRMSNorm(
            config.hidden_size, norm_eps(config, first + 1)
        )
        self.mlp = AttnResMoE(config) if layer_idx in config.moe_layers else AttnResMLP(config)
        if config.attnres_mode != "baseline":
            self.attn_mixer = AttnResDepthMixer(config.hidden_size, config.depth_attention_eps)
            self.mlp_mixer = AttnResDepthMixer(config.hidden_size, config.depth_attention_eps)

    def forward(self, state, cos, sin, mask, cache):
        completed, partial = state
        attention = lambda normed: self.self_attn(normed, cos, sin, mask, cache)
        steps = (
            (self.closes[0], self.input_layernorm, attention, "attn_mixer"),
            (self.closes[1], self.post_attention_layernorm, self.mlp, "mlp_mixer"),
        )
        for closes, norm, fn, mixer in steps:
            if self.baseline:
                partial = partial + fn(norm(partial))
                continue
            if self.delta:  # the stream plus a mix of the completed blocks
                stream = sum(completed) + (0 if partial is None else partial)
                x = stream + getattr(self, mixer)(completed)
            else:
                x = getattr(self, mixer)(completed + ([partial] if partial is not None else []))
            out = fn(norm(x))
            partial = out if partial is None else partial + out
            if closes:
                completed, partial = completed + [partial], None
        return completed, partial


def attention_mask_4d(attention_mask, batch, q_len, past, device):
    """Boolean ``[b, 1, q, kv]`` (True = attend): causal after ``past`` cached positions, and
    the 2-D padding mask when given. None when every query may see every key (SDPA's fast path)."""
    kv_len = past + q_len
    keys = torch.arange(kv_len, device=device)
    mask = keys[None, :] <= (torch.arange(q_len, device=device) + past)[:, None]
    mask = mask[None, None].expand(batch, 1, q_len, kv_len)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -kv_len:].bool()
        # a padding query that sees no key would give NaN; its output is never used
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    if bool(mask.all()):
        return None
    return mask


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["AttnResDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, AttnResDepthMixer):
            with torch.no_grad():
                module.query.zero_()  # uniform depth attention at initialisation
                module.key_norm_weight.fill_(1.0)


class AttnResModel(AttnResPreTrainedModel):
    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            AttnResDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        if config.attnres_mode in ("full", "block"):
            self.final_mixer = AttnResDepthMixer(config.hidden_size, config.depth_attention_eps)
        self.norm = AttnResRMSNorm(config.hidden_size, norm_eps(config, None))
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        past_key_values=None,
        **kwargs,
    ):
        """Final-normed hidden states ``[b, s, h]`` and the cache (None without one)."""
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and cache is None:
            cache = DynamicCache()
        batch, q_len = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + q_len, device=x.device)[None]
            if attention_mask is not None:  # left padding: count only real tokens
                real = attention_mask.long().cumsum(-1) - 1
                position_ids = real.clamp(min=0)[:, -q_len:]
        cos, sin = rotary_cos_sin(self.config, position_ids, x.dtype)
        mask = attention_mask_4d(attention_mask, batch, q_len, past, x.device)
        state = ([], x) if self.config.attnres_mode == "baseline" else ([x], None)
        for layer in self.layers:
            state = layer(state, cos, sin, mask, cache)
        completed, partial = state
        if self.config.attnres_mode == "baseline":
            hidden = partial
        elif self.config.attnres_mode.startswith("delta_"):  # the stream: no final mix
            hidden = sum(completed) + (0 if partial is None else partial)
        else:
            hidden = self.final_mixer(completed + ([partial] if partial is not None else []))
        return self.norm(hidden), cache


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        past_key_values=None,
        **kwargs,
    ):
        hidden, cache = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        if isinstance(logits_to_keep, torch.Tensor):  # positions to keep
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep:  # the last N positions
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)[..., : self.config.vocab_size]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        fields = CausalLMOutputWithPast.__dataclass_fields__
        key = "cache" if "cache" in fields else "past_key_values"
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{key: cache})
