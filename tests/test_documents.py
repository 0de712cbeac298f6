"""Megatron's document options: masks and positions, and that they reach the model everywhere.

* ``ltor_masks`` on a hand-made two-document batch equals masks and positions written out by
  hand, and equals Megatron's own per-sample ``_get_ltor_masks_and_position_ids`` on random
  batches;
* the model uses them: per-sample positions rotate queries and keys like RoPE at those positions
  (a sample's second document gives the logits of that document alone, at position 0), and the
  loss mask gives Megatron's masked mean;
* a 2-stage pipeline with full recompute trains exactly like the single-process run with all
  three options on, and differently from a run with them off.
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.model.document_masks import DocumentOptions, ltor_masks
from attnres_dist.model.embedding_head import lm_loss
from tests.equivalence_helpers import assert_matches, overrides, train_case

EOD = 9


@pytest.fixture(scope="module", autouse=True)
def process_group():
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    init_distributed(ParallelDims(), seed=0)


# two samples: [doc A (3 tokens + EOD) | doc B], and [doc C + EOD | doc D + EOD | doc E]
BATCH = torch.tensor([[1, 2, 3, EOD, 4, 5], [6, EOD, 7, 8, EOD, 1]])


def test_two_document_batch_by_hand():
    mask, loss_mask, positions = ltor_masks(BATCH, EOD, True, True, True)
    # True = masked out. Row i is what token i may NOT attend to.
    x, o = True, False
    expected_mask = torch.tensor(
        [
            [  # sample 0: tokens 0-3 are doc A (EOD included), 4-5 doc B
                [o, x, x, x, x, x],
                [o, o, x, x, x, x],
                [o, o, o, x, x, x],
                [o, o, o, o, x, x],
                [x, x, x, x, o, x],
                [x, x, x, x, o, o],
            ],
            [  # sample 1: tokens 0-1 doc C, 2-4 doc D, 5 doc E
                [o, x, x, x, x, x],
                [o, o, x, x, x, x],
                [x, x, o, x, x, x],
                [x, x, o, o, x, x],
                [x, x, o, o, o, x],
                [x, x, x, x, x, o],
            ],
        ]
    )
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[:, 0], expected_mask)
    assert torch.equal(positions, torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 0, 1, 2, 0]]))
    assert torch.equal(loss_mask, torch.tensor([[1.0, 1, 1, 0, 1, 1], [1, 0, 1, 1, 0, 1]]))
    # options off: causal mask, plain positions, every position counts
    mask, loss_mask, positions = ltor_masks(BATCH, EOD)
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    assert torch.equal(mask[:, 0], causal.expand(2, 6, 6))
    assert torch.equal(positions, torch.arange(6).expand(2, 6))
    assert torch.equal(loss_mask, torch.ones(2, 6))
    # each option alone changes only its own output
    mask, _, positions = ltor_masks(BATCH, EOD, reset_position_ids=True)
    assert torch.equal(mask[:, 0], causal.expand(2, 6, 6))
    assert torch.equal(positions, torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 0, 1, 2, 0]]))


def test_equals_megatron_per_sample_function():
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = torch.randint(0, 6, (3, 17), generator=gen)
        for flags in [(a, b, c) for a in (False, True) for b in (False, True) for c in (0, 1)]:
            mask, loss_mask, positions = ltor_masks(tokens, 5, *flags)
            for i in range(3):
                ref = _get_ltor_masks_and_position_ids(tokens[i], 5, *flags, True)
                assert torch.equal(mask[i], ref[0]), flags
                assert torch.equal(loss_mask[i], ref[1]) and torch.equal(positions[i], ref[2])


def tiny_model(documents):
    from attnres_dist.config import ModelConfig
    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8)
    model = AttnResGPT(ModelBuilder(cfg, 16, seed=3, documents=documents))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the same non-zero queries, so depth attention is not a plain mean
        for name, p in model.named_parameters():
            if name.endswith("mixer_weights"):  # [mixers, (query, key gain), D]
                p[:, 0].copy_(torch.randn(p[:, 0].shape, generator=gen) * 0.5)
    return model.eval()


@torch.no_grad()
def test_reset_options_reach_the_model():
    """With both resets, the second document of a sample is computed as if it stood alone at
    the start of a sample: its own tokens at positions 0, 1, ... (RoPE) and nothing before it."""
    reset = tiny_model(DocumentOptions(EOD, True, True))
    plain = tiny_model(None)
    sample = torch.tensor([[1, 2, 3, EOD, 4, 5, 6, 7]])
    alone = torch.tensor([[4, 5, 6, 7]])
    got = reset(sample)[4:]  # [s, b, v]: logits of doc B's tokens
    torch.testing.assert_close(got, plain(alone), atol=1e-5, rtol=1e-5)
    assert (plain(sample)[4:] - plain(alone)).abs().max() > 1e-3  # without resets they differ
    # the first document is unchanged by the resets
    torch.testing.assert_close(reset(sample)[:4], plain(sample)[:4], atol=1e-6, rtol=1e-6)
    # positions alone: doc B sees doc A but at restarted positions, so it differs from both
    positions_only = tiny_model(DocumentOptions(EOD, reset_position_ids=True))(sample)[4:]
    assert (positions_only - got).abs().max() > 1e-3
    assert (positions_only - plain(sample)[4:]).abs().max() > 1e-3


def test_eod_mask_loss_is_megatrons_masked_mean():
    torch.manual_seed(0)
    logits = torch.randn(6, 2, 16)  # [s, b, v]
    labels = torch.randint(0, 16, (2, 6))
    mask = torch.tensor([[1.0, 1, 1, 0, 1, 1], [1, 0, 1, 1, 0, 1]])
    per_token = torch.nn.functional.cross_entropy(
        logits.transpose(0, 1).reshape(-1, 16), labels.reshape(-1), reduction="none"
    )
    expected = (per_token * mask.reshape(-1)).sum() / mask.sum()
    # (clones: Megatron's vocab-parallel cross entropy works in place on fp32 logits)
    torch.testing.assert_close(lm_loss(logits.clone(), labels, mask), expected)
    torch.testing.assert_close(lm_loss(logits.clone(), labels), per_token.mean())
    model = tiny_model(DocumentOptions(EOD, eod_mask_loss=True))
    window = torch.tensor([[1, 2, EOD, 4, 5, 6, 7, 8, 3], [EOD, 5, 6, 7, EOD, 1, 2, 3, 4]])
    tokens, targets = window[:, :-1], window[:, 1:]
    with torch.no_grad():
        by_hand = lm_loss(model(tokens), targets, (tokens != EOD).float()).item()
        unmasked = lm_loss(model(tokens), targets).item()
        assert model.loss(window).item() == by_hand
        assert abs(by_hand - unmasked) > 1e-4


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    """Documents of 3-12 bytes: nearly every 16-token sample holds several EODs."""
    from attnres_dist.data import build_tokenizer, prepare_dataset

    tmp = tmp_path_factory.mktemp("short")
    words = ["def", "x = 1", "return y", "pass", "import os", "a + b", "if z:", "for i in r"]
    lines = [f'{{"text": "{words[i % 8]} {i}"}}' for i in range(400)]
    (tmp / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return prepare_dataset(
        [str(tmp / "docs.jsonl")],
        str(tmp / "short"),
        build_tokenizer("bytes", None),
        valid_fraction=0.2,
    )


def single_process(args: list[str]) -> dict:
    """The reference run in this process (as ``tests/workers/train_case.py`` does it)."""
    from attnres_dist.config import load_config
    from attnres_dist.train.trainer import Trainer
    from tests.test_checkpoint import in_process

    with in_process():
        trainer = Trainer(load_config(None, args))
        summary = trainer.train()
        return {"losses": summary["train_losses"], "params": trainer.engine.full_state()}


@pytest.mark.slow
def test_document_options_through_the_pipeline(short_docs, tmp_path):
    flags = {
        "data.reset_position_ids": True,
        "data.reset_attention_mask": True,
        "data.eod_mask_loss": True,
        "data.cache_dir": str(tmp_path / "cache"),
    }
    cache = {"data.cache_dir": flags["data.cache_dir"]}
    ref = single_process(overrides(short_docs, "block", str(tmp_path / "r"), **flags))
    off = single_process(overrides(short_docs, "block", str(tmp_path / "o"), **cache))
    assert abs(off["losses"][0] - ref["losses"][0]) > 1e-3  # the options change training
    pipelined = overrides(
        short_docs, "block", str(tmp_path / "p"), pp=2, **flags, **{"parallel.recompute": "full"}
    )
    assert_matches(train_case(tmp_path, "pp2", pipelined, 2), ref, "documents pp=2 full")
