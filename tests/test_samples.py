"""Samples from megatron-core's GPTDataset / BlendedMegatronDatasetBuilder.

Documents here are runs of one token value (doc ``i`` of a dataset is ``[base + i] * n_i`` then
EOD), so a sample's tokens tell which documents, and which dataset, it was cut from.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from attnres_dist.config import DataConfig
from attnres_dist.data import indexed
from attnres_dist.data.blend import parse_blend, parse_split
from attnres_dist.data.gpt_samples import open_dataset, open_samples, plan_data
from attnres_dist.data.tokenizer import ByteTokenizer
from attnres_dist.errors import ConfigError, DataError

EOD = ByteTokenizer.eod
SEQ = 8


def doc(base: int, i: int) -> list[int]:
    return [base + i] * (3 + (7 * i) % 11)


def prepared(path, base: int, train_docs: int = 40, valid_docs: int = 10) -> str:
    """A prepare-data dataset written directly: train docs first, then valid docs."""
    with indexed.DatasetWriter(str(path), ByteTokenizer()) as writer:
        for i in range(train_docs):
            writer.add("train", doc(base, i))
        for i in range(train_docs, train_docs + valid_docs):
            writer.add("valid", doc(base, i))
        writer.commit()
    return str(path)


def raw(path, base: int, docs: int = 50) -> str:
    """One Megatron indexed dataset (PREFIX.bin/.idx), as Megatron's preprocess_data writes."""
    builder = indexed._mcore().IndexedDatasetBuilder(str(path) + ".bin", dtype=np.uint16)
    for i in range(docs):
        tokens = np.array(doc(base, i) + [EOD], dtype=np.int64)
        builder.add_document(tokens, [tokens.size])
    builder.finalize(str(path) + ".idx")
    return str(path)


def docs_of(window: torch.Tensor, base: int) -> set[int]:
    return {int(t) - base for t in window if int(t) != EOD}


def test_samples_are_megatron_windows_of_the_shuffled_documents(tmp_path):
    prefix = prepared(tmp_path / "a", base=10)
    train, valid, meta = open_dataset(prefix, SEQ, seed=5, cache_dir=str(tmp_path))
    gpt = train.dataset  # the GPTDataset
    docs = [doc(10, i) + [EOD] for i in range(40)]
    stream = np.concatenate([docs[d] for d in gpt.document_index])
    n = len(train)
    assert n == (stream.size - 1) // SEQ  # one epoch: the shuffled stream, cut with stride SEQ
    assert sorted(gpt.shuffle_index.tolist()) == list(range(n))
    for i in (0, 1, n // 2, n - 1):
        start = int(gpt.shuffle_index[i]) * SEQ
        assert np.array_equal(train.window(i).numpy(), stream[start : start + SEQ + 1])
    assert sorted(gpt.document_index.tolist()) == list(range(40))  # every document, once
    assert all(docs_of(valid.window(i), 10) <= set(range(40, 50)) for i in range(len(valid)))
    assert os.listdir(tmp_path / "indices")  # Megatron's index cache


def test_global_batch_is_a_pure_function_of_the_step(tmp_path):
    prefix = prepared(tmp_path / "a", base=10)
    cache = str(tmp_path / "c")
    train, _, _ = open_dataset(prefix, SEQ, seed=1, train_samples=60, cache_dir=cache)
    assert len(train) >= 60  # more than one epoch (~45 samples) when asked for
    batches = [train.global_batch(s, 6) for s in range(10)]
    stamps = {f: os.stat(f).st_mtime_ns for f in (tmp_path / "c" / "indices").glob("*.npy")}
    again, _, _ = open_dataset(prefix, SEQ, seed=1, train_samples=60, cache_dir=cache)
    assert {f: os.stat(f).st_mtime_ns for f in stamps} == stamps  # loaded, not rebuilt
    for s in reversed(range(10)):
        assert torch.equal(again.global_batch(s, 6), batches[s])
    other, _, _ = open_dataset(prefix, SEQ, seed=2, train_samples=60, cache_dir=cache)
    assert not torch.equal(other.global_batch(0, 6), batches[0])
    with pytest.raises(ValueError, match="outside the"):
        train.global_batch(len(train) // 6 + 1, 6)


def test_eval_batches_spread_over_the_whole_split(tmp_path, recwarn):
    prefix = prepared(tmp_path / "a", base=10, train_docs=20, valid_docs=30)
    _, valid, _ = open_dataset(prefix, SEQ, cache_dir=str(tmp_path))
    n = len(valid)
    batches = valid.eval_batches(2, 3)
    assert [b.shape for b in batches] == [(3, SEQ + 1)] * 2
    ids = [k * n // 6 for k in range(6)]
    for row, i in zip(torch.cat(batches), ids, strict=True):
        assert torch.equal(row, valid.window(i))
    assert ids[-1] >= n * 5 // 6 - 1  # reaches the end of the split, not just its start
    capped = valid.eval_batches(10_000, 4)
    assert len(capped) == n // 4 and any(
        "evaluation batches fit" in str(w.message) for w in recwarn
    )
    with pytest.raises(DataError, match="fewer than one evaluation batch"):
        valid.eval_batches(1, n + 1)


def test_split_string_splits_one_indexed_dataset_by_document(tmp_path):
    prefix = raw(tmp_path / "raw", base=10, docs=50)
    cfg = DataConfig(path=prefix, split="7,2,1")
    plan = plan_data(cfg)
    assert plan.meta["max_token_id"] == EOD and plan.meta["eod"] == EOD
    train, valid, test = open_samples(plan, SEQ, 0, 40, 4, str(tmp_path))
    seen = [
        set().union(*(docs_of(s.window(i), 10) for i in range(len(s))))
        for s in (train, valid, test)
    ]
    assert seen[0] <= set(range(35)) and seen[1] <= set(range(35, 45))
    assert seen[2] <= set(range(45, 50)) and all(seen)
    no_test = plan_data(DataConfig(path=prefix, split="9,1"))
    _, _, none = open_samples(no_test, SEQ, 0, 40, 4, str(tmp_path))
    assert none is None  # no test share, no test split


def test_weighted_blend_of_prepared_datasets(tmp_path):
    a, b = prepared(tmp_path / "a", base=10), prepared(tmp_path / "b", base=100)
    pairs = DataConfig(paths=[3, a, "1", b])
    plan = plan_data(pairs)
    assert plan.blend.weights == (3.0, 1.0) and plan.meta["blend"] == [a, b]
    train, valid, _ = open_samples(plan, SEQ, 0, 400, 8, str(tmp_path))
    rows = train.global_batch(0, 400)
    from_a = sum(bool(docs_of(r, 10) <= set(range(40))) for r in rows)
    assert abs(from_a - 300) <= 2  # Megatron's blending follows the weights closely
    held_out = valid.eval_batches(1, 8)[0]
    assert all(docs_of(r, 10) <= set(range(40, 50)) or docs_of(r, 100) <= set(range(40, 50))
               for r in held_out)  # fmt: skip
    mapping = DataConfig(paths=[{"path": a, "weight": 3}, {"path": b, "weight": 1}])
    same, _, _ = open_samples(plan_data(mapping), SEQ, 0, 400, 8, str(tmp_path))
    assert torch.equal(same.global_batch(3, 16), train.global_batch(3, 16))


def test_blend_and_split_parsing():
    assert parse_blend(["only"]).weights is None
    assert parse_blend([0.5, "a", "1.5", "b"]).weights == (0.5, 1.5)
    for bad, message in (
        ([1, "a", "x", "b"], r"weight 'x' is not a number"),
        ([0, "a", 0, "b"], r"weight 0 must be a finite number > 0"),
        ([1, "a", 2], r"has 3 entries, not weight/prefix pairs"),
        ([1, "a", 1, "a"], r"names a prefix twice"),
        ([{"path": "a", "wieght": 1}], r"\[0\]: got"),
        ([], r"got \[\]"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_blend(bad)
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.03, 0.001))
    assert parse_split("98,2") == pytest.approx((0.98, 0.02, 0.0))
    for bad in ("a,b", "1,2,3,4", "-1,2", "100,0,0", "0,1,0", ""):
        with pytest.raises(ConfigError, match="data.split"):
            parse_split(bad)


def test_blend_needs_one_tokenizer_and_every_prefix(tmp_path):
    a = prepared(tmp_path / "a", base=10)
    with pytest.raises(DataError, match=r"missing\.meta\.json: dataset metadata not found"):
        plan_data(DataConfig(paths=[1, a, 1, str(tmp_path / "missing")]))
    other = prepared(tmp_path / "o", base=10)
    meta_file = tmp_path / "o.meta.json"
    meta = json.loads(meta_file.read_text())
    meta["eod"] = 0
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="eod 0 differs from .*a's 256; a blend needs"):
        plan_data(DataConfig(paths=[1, a, 1, other]))
    with pytest.raises(DataError, match=r"raw\.bin: file not found"):
        plan_data(DataConfig(path=str(tmp_path / "raw"), split="9,1"))


def test_resume_of_a_blend_with_document_options_is_exact(small_dataset, tmp_path):
    """Stopped after step 2 and resumed == uninterrupted, bitwise, on a weighted blend with
    Megatron's document options: the data position is the step, nothing else."""
    from attnres_dist.checkpoint import store
    from tests.test_checkpoint import RESUME_AT, args_for, final_state, train

    other = prepared(tmp_path / "other", base=20, train_docs=100, valid_docs=20)
    extra = {
        "data.reset_attention_mask": True,
        "data.reset_position_ids": True,
        "data.eod_mask_loss": True,
        "data.cache_dir": str(tmp_path / "cache"),
    }

    def args(run_dir, **more):
        words = args_for(small_dataset, run_dir, **extra, **more)
        blend = f"data.paths=[2,{small_dataset},1,{other}]"
        return [blend if w.startswith("data.path=") else w for w in words]

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "resumed"
    ref = train(ref_dir, args(ref_dir), 1)
    start = str(ref_dir / "checkpoints" / store.step_name(RESUME_AT))
    resumed = train(run_dir, args(run_dir, **{"checkpoint.resume": start}), 1)
    assert resumed["start_step"] == RESUME_AT
    assert resumed["train_losses"] == ref["train_losses"][RESUME_AT:]
    assert resumed["final_valid_loss"] == ref["final_valid_loss"]
    ours, theirs = final_state(run_dir), final_state(ref_dir)
    assert all(torch.equal(ours[k], v) for k, v in theirs.items()) and ours.keys() == theirs.keys()
