"""The two numbers before a training step is timed: its FLOPs and the bytes Block AttnRes adds.

* ``matmul_flops`` and ``attention_flops``: the model FLOPs of one training step (forward and
  backward, 3x the forward) of the GPT shape the project and ``plain_gpt.PlainGPT`` share: per
  layer the QKV projection (grouped-query), the output projection, SwiGLU's gate/up and down
  matrices, the tied LM head; causal attention's two products counted over the half of the
  score matrix a causal kernel computes. Over a measured bf16 matrix-product rate they give the
  step's arithmetic floor, and MFU. The depth mixing's own FLOPs are not counted: at these
  widths they are bytes, not arithmetic (below), and leaving them out keeps one numerator for
  baseline, Block and Full.
* ``block_extra_bytes``: the bytes Block AttnRes (two-phase) must move through device memory
  beyond the baseline residual in one training step, from the paper's Table 1: per token and
  sublayer (N/S + 5) d against the standard residual's 3 d, N blocks of S sublayers; counted
  once for the forward and once for the backward (which at least reads what the forward
  read). Over the measured copy bandwidth this is the least time Block can add to a step.
"""

from __future__ import annotations

import math


def layer_matmul_params(hidden: int, heads: int, groups: int, ffn: int) -> int:
    """Weights one token multiplies through in one transformer layer (no biases)."""
    head_dim = hidden // heads
    qkv = hidden * (hidden + 2 * groups * head_dim)
    return qkv + hidden * hidden + hidden * 2 * ffn + ffn * hidden


def matmul_flops(
    layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int, tokens: int
) -> int:
    """Weight-matrix FLOPs of one training step over ``tokens`` tokens: 2 per multiply-add in
    the forward, twice that in the backward (input and weight gradients)."""
    params = layers * layer_matmul_params(hidden, heads, groups, ffn) + hidden * vocab
    return 3 * 2 * params * tokens


def attention_flops(layers: int, hidden: int, seq: int, tokens: int, causal: bool = True) -> int:
    """QK^T and PV of one training step: per token and layer 2 x 2 x seq x hidden forward
    (half of it under a causal mask), x3 with the backward."""
    per_token = 4 * seq * hidden * layers
    return 3 * (per_token // 2 if causal else per_token) * tokens


def block_extra_bytes(
    layers: int, block_size: int, hidden: int, tokens: int, element_bytes: int = 2
) -> int:
    """Table 1's bytes of Block AttnRes (two-phase) beyond the baseline residual, one step
    (forward and backward) over ``tokens`` tokens: (N/S + 5 - 3) d per token and sublayer."""
    sublayers = 2 * layers
    blocks = math.ceil(sublayers / block_size)
    per_token_sublayer = (blocks / block_size + 5 - 3) * hidden * element_bytes
    return round(2 * sublayers * tokens * per_token_sublayer)
