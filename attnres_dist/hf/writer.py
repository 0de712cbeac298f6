"""Write a Hugging Face ``transformers`` directory for a trained model.

    attnres-dist export runs/tiny --format hf --output exported/tiny-hf

The directory holds ``config.json`` (``model_type: attnres``, ``auto_map`` pointing at the
shipped code, the trainer's model config and the checkpoint's step and source under
``attnres_dist``), ``generation_config.json``, ``model.safetensors`` (Hugging Face names,
``weights.py``), ``configuration_attnres.py`` + ``modeling_attnres.py`` (copied from this
package; torch + transformers only) and the tokenizer (``tokenizer.py``). transformers' own
``save_pretrained`` writes the config and the weights, so the files are what its
``from_pretrained`` expects. Every file is written into a temporary sibling directory first
and moved into ``output`` only when all are complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from attnres_dist.config.block_plan import BLOCK_MODES
from attnres_dist.hf.tokenizer import write_tokenizer
from attnres_dist.hf.weights import hf_state_dict

HERE = Path(__file__).resolve().parent
SHIPPED = ("configuration_attnres.py", "modeling_attnres.py")


def quiet_transformers() -> None:
    """No progress bars or notices from transformers' loading and saving (one line per command)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def hf_config(model, vocab_size: int, padded_vocab_size: int, eos_token_id: int, extra: dict):
    """The ``AttnResConfig`` of trainer model config ``model`` (a ``ModelConfig``)."""
    from attnres_dist.hf.configuration_attnres import AttnResConfig

    mode = model.attnres.mode
    return AttnResConfig(
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        head_dim=model.kv_channels,
        qk_norm=model.qk_norm,
        max_position_embeddings=model.seq_length,
        rope_theta=float(model.rotary_base),
        rope_llama3_factor=model.rope_scaling_factor,
        rms_norm_eps=model.norm_eps,
        attnres_mode=mode,
        attnres_block_size=model.attnres.block_size if mode in BLOCK_MODES else 1,
        attnres_source_scaled_eps=model.attnres.source_scaled_eps,
        num_experts=model.moe.num_experts,
        num_experts_per_tok=model.moe.top_k,
        moe_intermediate_size=model.expert_ffn_size,
        shared_expert_intermediate_size=model.moe.shared_expert_ffn_hidden_size,
        moe_layers=[i for i in range(model.num_layers) if model.moe.is_moe_layer(i)],
        router_dtype=model.moe.router_dtype,
        router_pre_softmax=model.moe.pre_softmax,
        tie_word_embeddings=model.tie_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,  # as Llama exports do: padded batches need a pad id
        architectures=["AttnResForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_attnres.AttnResConfig",
            "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
        },
        attnres_dist=extra,
    )


def hf_model(tensors: dict, config):
    """``AttnResForCausalLM`` holding canonical ``tensors`` (no second copy of any weight)."""
    import torch

    from attnres_dist.hf.modeling_attnres import AttnResForCausalLM

    state = hf_state_dict(
        tensors, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    )
    dtype = next(iter(state.values())).dtype
    with torch.device("meta"):
        model = AttnResForCausalLM(config).to(dtype)
    expected = {name for name, _ in model.named_parameters()}  # tied head listed once
    if set(state) != expected:
        raise KeyError(
            f"weights do not match the model config: missing {sorted(expected - set(state))[:3]}"
            f", unexpected {sorted(set(state) - expected)[:3]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def write_hf_export(output, tensors: dict, model, padded_vocab: int, tokenizer: dict, extra):
    """Write the directory; ``model`` is the run's ``ModelConfig``, ``tokenizer`` the
    checkpoint's tokenizer record, ``extra`` what to keep under ``config.attnres_dist``."""
    quiet_transformers()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        eod = write_tokenizer(tmp, tokenizer, model.seq_length)
        # the logits cover the model's own vocabulary where the run set one (an imported
        # model's, which may exceed its tokenizer's), else the tokenizer's
        vocab = int(model.vocab_size or tokenizer.get("vocab_size") or padded_vocab)
        config = hf_config(model, vocab, padded_vocab, eod, extra)
        hf_model(tensors, config).save_pretrained(tmp)  # config, generation config, weights
        for name in SHIPPED:
            shutil.copyfile(HERE / name, tmp / name)
        output.mkdir(exist_ok=True)
        for path in sorted(tmp.iterdir()):
            os.replace(path, output / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output
