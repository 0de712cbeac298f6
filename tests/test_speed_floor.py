"""The speed step's floors (bench/speed_floor.py) against independent counts:
torch's FlopCounterMode over PlainGPT's forward and backward (an outside count of every matrix
product), and hand-computed cases of the attention products and of Table 1's bytes."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from attnres_dist.config import load_config
from bench.plain_gpt import PlainGPT
from bench.speed_floor import attention_flops, block_extra_bytes, matmul_flops


def test_matmul_flops_match_torchs_flop_counter_on_the_plain_gpt():
    shape = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4"]
    shape += ["model.num_query_groups=2", "model.seq_length=16"]
    model = load_config(None, shape).model
    gpt = PlainGPT(model, vocab_size=50)
    window = torch.randint(0, 50, (3, 17), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        gpt.loss(window).backward()
    # on a CPU SDPA's kernel is not counted: what is counted is every matrix product
    assert set(map(str, counter.get_flop_counts()["Global"])) == {"aten.mm"}
    heads, groups = 4, 2
    counted = matmul_flops(2, 32, heads, groups, model.ffn_size, 50, tokens=3 * 16)
    assert counted == counter.get_total_flops()


def test_attention_flops_by_hand():
    # 1 layer, d = 4, 3 positions, 3 tokens: QK^T and PV forward 2 x 2 x 3 x 4 = 48 per token
    assert attention_flops(1, 4, 3, 3, causal=False) == 3 * 48 * 3
    assert attention_flops(1, 4, 3, 3) == 3 * 24 * 3


def test_block_extra_bytes_by_hand_at_the_125m_shape():
    # 12 layers = 24 sublayers in blocks of 3: N = 8, N/S = 8/3; (8/3 + 2) x 768 = 3584
    # elements of 2 bytes per token and sublayer, x 24 sublayers x 8192 tokens x 2 (fwd, bwd)
    assert block_extra_bytes(12, 3, 768, 8192) == 7168 * 24 * 8192 * 2 == 2_818_572_288
    # 24 layers x 2048 in blocks of 6 (N = 8): (8/6 + 2) x 2048 = 6826.67 elements
    assert block_extra_bytes(24, 6, 2048, 8192) == round(2 * 48 * 8192 * (8 / 6 + 2) * 2048 * 2)
