"""A Llama-family Hugging Face checkpoint directory, read as this trainer's model, or refused.

``read_source(directory)`` checks everything before anything is written and returns a
``LlamaSource``: the trainer's model fields derived from ``config.json`` (layers, hidden size,
heads, query groups, FFN size, RMSNorm epsilon, RoPE base and Llama-3 RoPE scaling, vocabulary,
sequence length, tied head), the tokenizer file and the safetensors files that hold the weights
(one ``model.safetensors`` or the shards a ``model.safetensors.index.json`` names).

What Megatron-Core's layers as this trainer builds them cannot represent is refused with one
line naming the field and why: another architecture (GPT-2, Qwen2's QKV biases, ...),
attention or MLP biases, a sliding window, an activation other than SiLU, RoPE scalings other
than Llama 3's with Megatron's fixed frequency bands (``low_freq_factor`` 1,
``high_freq_factor`` 4, 8192 original positions), and a tokenizer with more tokens than the
embedding has rows. Read beside Llama and Mistral: Qwen3 (heads of any width, each head's
query and key normed), and the experts of Mixtral and Qwen3-MoE (``_moe``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from attnres_dist.errors import UserError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",  # Mistral's layers with a mixture-of-experts MLP
    "qwen3": "Qwen3ForCausalLM",  # Llama's layers with each head's query and key normed
    "qwen3_moe": "Qwen3MoeForCausalLM",  # Qwen3's with mixture-of-experts MLPs
}
QK_NORMED = ("qwen3", "qwen3_moe")
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Megatron-Core 0.16's RotaryEmbedding applies Llama 3's scaling with these bands fixed
MEGATRON_LLAMA3_BANDS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# default sequence length of a continued-pretraining run: the source's, up to this
MAX_SEQ = 2048


@dataclass
class LlamaSource:
    directory: Path
    config: dict  # config.json as read
    model: dict  # the trainer's model.* fields (ModelConfig names), without attnres
    tokenizer: Path
    weight_files: list[Path]
    tokenizer_vocab: int  # tokens of tokenizer.json, added ones included
    eod: int  # its end-of-text id

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.config["model_type"]]


def _refuse(field: str, why: str):
    raise UserError(f"config.json: {field}", why)


def _vocab_multiple(vocab: int) -> int:
    """The largest power of two up to 128 dividing ``vocab``: Megatron's vocabulary padding
    then adds no rows at tensor-parallel sizes that divide it (the source's softmax stays the
    same: padding rows would add logits of their own)."""
    multiple = 128
    while vocab % multiple:
        multiple //= 2
    return multiple


def _rope(cfg: dict) -> tuple[int, float | None]:
    """(RoPE base, Llama-3 scaling factor or None); transformers 4 and 5 spellings."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    scaling = {**scaling, **params}
    if float(theta) != int(theta):
        _refuse("rope_theta", f"got {theta}; the trainer's model.rotary_base is an integer")
    if kind == "default":
        return int(theta), None
    if kind != "llama3":
        _refuse(
            "rope_scaling",
            f"rope_type {kind!r} is not supported; Megatron-Core applies only Llama 3's scaling",
        )
    for key, value in MEGATRON_LLAMA3_BANDS.items():
        if float(scaling.get(key, value)) != float(value):
            _refuse(
                f"rope_scaling.{key}",
                f"got {scaling.get(key)}; Megatron-Core's Llama 3 scaling fixes it at {value}",
            )
    return int(theta), float(scaling.get("factor", 8.0))


def derive_model(cfg: dict) -> dict:
    """The trainer's ``model.*`` fields for a Llama-family ``config.json`` (or a refusal)."""
    kind = cfg.get("model_type")
    if kind not in ARCHITECTURES:
        _refuse(
            "model_type",
            f"got {kind!r}; import-hf reads Llama-architecture models "
            f"({', '.join(sorted(ARCHITECTURES))})",
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            _refuse(key, "biases are not supported: the trainer's layers have no bias")
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True):
        _refuse("sliding_window", "sliding-window attention is not supported; only full causal")
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", f"got {cfg['hidden_act']!r}; the trainer's MLP is SwiGLU (silu)")
    if int(cfg.get("pretraining_tp", 1)) != 1:
        _refuse("pretraining_tp", "must be 1 (sliced projections are not supported)")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    groups = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None and hidden % heads:
        _refuse("head_dim", f"missing, and num_attention_heads={heads} does not divide {hidden}")
    head_dim = None if head_dim in (None, hidden // heads) else int(head_dim)
    if heads % groups:
        _refuse("num_key_value_heads", f"got {groups}; must divide num_attention_heads={heads}")
    theta, scaling = _rope(cfg)
    vocab = int(cfg["vocab_size"])
    return _moe(cfg) | {
        "num_layers": int(cfg["num_hidden_layers"]),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "head_dim": head_dim,
        "qk_norm": kind in QK_NORMED,
        "ffn_hidden_size": int(cfg["intermediate_size"]),
        "seq_length": min(int(cfg.get("max_position_embeddings", MAX_SEQ)), MAX_SEQ),
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": _vocab_multiple(vocab),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rotary_base": theta,
        "rope_scaling_factor": scaling,
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "hidden_dropout": 0.0,
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
    }


def _moe(cfg: dict) -> dict:
    """The experts as ``model.moe.*`` fields; none for a dense model.

    Mixtral: every layer MoE, the top-k experts weighted by the softmax over their logits (the
    softmax over all, renormalised), the trainer's routing for k > 1; at k = 1 that weight is
    1, where Megatron's top-1 takes the expert's softmax over all logits: refused. Qwen3-MoE:
    the layers ``decoder_sparse_step`` picks, less ``mlp_only_layers``, as a pattern; with
    ``norm_topk_prob`` the Mixtral weighting, without it each expert's softmax over all
    logits (``router_pre_softmax``)."""
    kind = cfg.get("model_type")
    if kind not in ("mixtral", "qwen3_moe"):
        return {}
    top_k = int(cfg.get("num_experts_per_tok", 2))
    renormalised = kind == "mixtral" or bool(cfg.get("norm_topk_prob", False))
    if top_k < 2 and renormalised:
        _refuse(
            "num_experts_per_tok",
            f"got {top_k}; the trainer's top-1 routing weights the expert by its softmax over "
            "all logits, this model's by 1: import a model that routes to 2 or more experts",
        )
    fields = {
        "moe.top_k": top_k,
        "moe.aux_loss_coeff": float(cfg.get("router_aux_loss_coef", 0.0)),
        "moe.router_pre_softmax": not renormalised,
    }
    if kind == "mixtral":
        experts, width = int(cfg["num_local_experts"]), int(cfg["intermediate_size"])
        return fields | {"moe.num_experts": experts, "moe.expert_ffn_hidden_size": width}
    layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return fields | {
        # transformers names it num_local_experts, as Mixtral's; earlier configs num_experts
        "moe.num_experts": int(cfg.get("num_local_experts") or cfg["num_experts"]),
        "moe.expert_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
        "moe.pattern": "[" + ",".join(map(str, pattern)) + "]",
    }


def _weight_files(directory: Path) -> list[Path]:
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError):
            raise UserError(str(index), "not a safetensors index (no weight_map)") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise UserError(str(directory / missing[0]), f"named by {WEIGHTS_INDEX} but missing")
        return [directory / n for n in names]
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    raise UserError(
        str(directory),
        f"no {WEIGHTS} or {WEIGHTS_INDEX}; import-hf reads safetensors weights (save the "
        "model with transformers' save_pretrained)",
    )


def _check_tokenizer(path: Path, vocab: int, eos_token_id):
    """The tokenizer, once it is known to belong to these weights."""
    from attnres_dist.data.tokenizer import HFTokenizer

    if not path.is_file():
        raise UserError(str(path), "missing; import-hf needs the model's tokenizer.json")
    tokenizer = HFTokenizer(str(path))  # unreadable or without an end-of-text token: one line
    if tokenizer.vocab_size > vocab:
        raise UserError(
            str(path),
            f"has {tokenizer.vocab_size} tokens but config.json's vocab_size is {vocab}: the "
            "tokenizer does not belong to these weights",
        )
    if isinstance(eos_token_id, int) and eos_token_id != tokenizer.eod:
        raise UserError(
            str(path),
            f"its end-of-text token is id {tokenizer.eod} but config.json's eos_token_id is "
            f"{eos_token_id}: the tokenizer does not belong to these weights",
        )
    return tokenizer


def read_source(directory: str | Path) -> LlamaSource:
    """The checked source; raises ``UserError`` (one line) for anything it cannot import."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file():
        raise UserError(str(directory), f"no {CONFIG}: not a Hugging Face model directory")
    try:
        cfg = json.loads((directory / CONFIG).read_text())
    except ValueError as exc:
        raise UserError(str(directory / CONFIG), f"not valid JSON ({exc})") from None
    try:
        model = derive_model(cfg)
    except KeyError as exc:
        raise UserError(f"config.json: {exc.args[0]}", "missing; the model needs it") from None
    tok = _check_tokenizer(directory / TOKENIZER, model["vocab_size"], cfg.get("eos_token_id"))
    files = _weight_files(directory)
    return LlamaSource(directory, cfg, model, directory / TOKENIZER, files, tok.vocab_size, tok.eod)


def read_weights(source: LlamaSource) -> dict:
    """Every tensor of the source's safetensors files, in its stored dtype, by its Hugging Face
    name."""
    from safetensors import safe_open

    out = {}
    for path in source.weight_files:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                out[key] = fh.get_tensor(key)
    return out
