"""Translate the project's ModelConfig into Megatron-Core's TransformerConfig.

Local (non-Transformer-Engine) layer spec: RMSNorm, SwiGLU MLP, rotary embeddings, no biases.
On CPU the fused CUDA kernels are switched off (DESIGN.md section 4); on GPU the same config
runs unchanged. Megatron's own pipeline machinery is not used (DeepSpeed runs the schedule),
so Megatron is told pipeline size 1 and sees only the tensor-parallel dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnres_dist.config import ModelConfig


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Pad the vocabulary to a multiple of ``lcm(divisible_by, tp)``.

    Megatron pads to ``divisible_by * tp``, which makes the model (its softmax over padding
    ids) depend on the tensor-parallel size; the least common multiple keeps one model for
    every layout while still splitting evenly over the tensor ranks.
    """
    multiple = math.lcm(divisible_by, tp)
    return ((vocab_size + multiple - 1) // multiple) * multiple


def moe_fields(model: ModelConfig, ep: int = 1) -> dict:
    """Megatron-Core's MoE fields for ``model.moe`` (none for a dense model)."""
    moe = model.moe
    if not moe.enabled:
        return {}
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        # the chosen experts' weights: each one's softmax over all logits (Megatron's
        # pre-softmax; Switch's top-1), or the softmax over the chosen logits (Mixtral's)
        "moe_router_pre_softmax": moe.pre_softmax,
        "moe_ffn_hidden_size": model.expert_ffn_size,
        "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
        "moe_router_load_balancing_type": moe.load_balancing,
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        "moe_z_loss_coeff": moe.z_loss_coeff,
        "moe_expert_capacity_factor": moe.capacity_factor,
        "moe_router_dtype": None if moe.router_dtype == "model" else moe.router_dtype,
        "moe_token_dispatcher_type": moe.token_dispatcher,
        "moe_grouped_gemm": False,  # SequentialMLP: grouped GEMM needs its CUDA library
        "expert_model_parallel_size": ep,
    }


def transformer_config(
    model: ModelConfig,
    tp: int = 1,
    dtype=torch.float32,
    on_gpu=None,
    ep: int = 1,
    sequence_parallel: bool = False,
):
    """``on_gpu``: the model runs on a GPU (default: CUDA is visible); enables fused softmax.
    ``ep``: the expert-parallel size (MoE models); ``sequence_parallel``: Megatron's (tp > 1)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        qk_layernorm=model.qk_norm,
        ffn_hidden_size=model.ffn_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_std,
        use_cpu_initialization=True,  # identical weights for every tp/pp from one seed
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=on_gpu,
        # off on every device: the functions they call are left uncompiled (see megatron_jit)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        sequence_parallel=sequence_parallel,
        **moe_fields(model, ep),
    )
