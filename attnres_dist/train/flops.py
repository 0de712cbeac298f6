"""Model FLOPs per token, and model FLOPs utilisation (MFU).

Counted as the matrix multiplications of one training step (forward + backward = 3 x forward:
each matmul's backward computes the input gradient and the weight gradient), in the usual MFU
convention: model FLOPs, so activation recompute is not counted, nor are elementwise work, norms
and softmax. Per token, with L layers, hidden h, heads n of size d = h / n, query groups g,
SwiGLU width f, sequence length s and (padded) vocabulary V:

* attention projections: ``2 h (n d + 2 g d)`` (QKV) + ``2 n d h`` (output), ``d`` the head
  size (``n d = h`` unless ``model.head_dim`` says otherwise)
* attention itself: ``4 s n d`` (scores and the weighted sum over all ``s`` keys; the local
  attention computes the full ``s x s`` product and masks it)
* SwiGLU MLP: ``6 h f`` (gate and up ``h -> 2f``, down ``f -> h``); an MoE layer's MLP counts
  the activated experts: ``6 h (k f_e + f_s)`` for top-k experts of width ``f_e`` and a shared
  expert of width ``f_s``, plus its router ``2 h E`` (E experts); tokens a capacity drops are
  counted as computed
* LM head: ``2 h V``
* depth attention, per sublayer mixing ``n`` sources: ``4 h n`` (one ``h``-long dot product per
  source for its logit, one multiply-add per element for the weighted sum); the keys' RMSNorm
  is not counted, as no norm of the layers is

``training = 3 * (L * (projections + attention + MLP) + head + 4 h N)`` where ``N`` is the number
of sources summed over all sublayers and the final aggregation (``BlockPlan``):
``L (2L + 1) + 2L + 1`` for Full AttnRes, at most ``(2L + 1)(N_blocks + 1)`` for Block, 0 for
the baseline.
The depth term is elementwise work in the code (no matmul), so ``FlopCounterMode`` does not see
it; ``tests/test_signals.py`` checks the matmul part against it exactly and the depth term
against a matmul formulation of the same products.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnres_dist.config.block_plan import BlockPlan

# dense bf16 peak TFLOP/s of one device, by a substring of torch.cuda.get_device_name()
KNOWN_PEAKS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0))


@dataclass(frozen=True)
class FlopsPerToken:
    matmul: float  # projections, attention, MLP and head (what FlopCounterMode counts)
    depth: float  # depth-attention logits and mixes

    @property
    def total(self) -> float:
        return self.matmul + self.depth


def depth_sources(plan: BlockPlan) -> int:
    """Sources mixed per token over all sublayers and the final aggregation (Delta: none)."""
    if plan.mode == "baseline":
        return 0
    total = sum(plan.num_sources(sub) for sub in range(1, plan.num_sublayers + 1))
    return total + (plan.final_num_sources if plan.has_final_mix else 0)


def training_flops_per_token(model, vocab_size: int) -> FlopsPerToken:
    """Model FLOPs of one training token (forward + backward) for a ``ModelConfig``."""
    h, s, f = model.hidden_size, model.seq_length, model.ffn_size
    n = model.num_attention_heads
    g = model.num_query_groups or n
    d = model.kv_channels
    attention = 2 * h * (n * d + 2 * g * d) + 2 * n * d * h + 4 * s * n * d
    moe = model.moe
    moe_mlp = 6 * h * (moe.top_k * model.expert_ffn_size + (moe.shared_expert_ffn_hidden_size or 0))
    moe_mlp += 2 * h * moe.num_experts
    mlps = [moe_mlp if moe.is_moe_layer(i) else 6 * h * f for i in range(model.num_layers)]
    forward = model.num_layers * attention + sum(mlps) + 2 * h * vocab_size
    depth = 4 * h * depth_sources(model.block_plan())
    return FlopsPerToken(matmul=3.0 * forward, depth=3.0 * depth)


def known_peak_tflops(device_name: str) -> float | None:
    for key, peak in KNOWN_PEAKS:
        if key in device_name:
            return peak
    return None


def mfu(flops_per_token: float, tokens_per_s: float, devices: int, peak_tflops: float) -> float:
    """Achieved model FLOP/s over the peak of all ``devices``."""
    return flops_per_token * tokens_per_s / (devices * peak_tflops * 1e12)
