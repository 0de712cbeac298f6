"""The Hugging Face export against the trainer's single-process model (fp32, in process).

The reference is ``AttnResGPT`` built from Megatron-Core's layers; the export is written with
the real writer and loaded through ``AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)``, i.e. the modeling file copied into the directory. Every 1-D weight
(norm gains, depth-attention queries and key gains) is randomised first, so the depth
attention is far from uniform and any mix-up of norms, blocks or sources shows.

Cases: baseline, Full, Block with an uneven last block (L = 8 sublayers, S = 3: blocks of 3,
3, 2), grouped-query attention, tied and untied heads. Generation: greedy tokens and per-step
logits of the cached decoder against the recompute-the-window reference, transformers'
``generate()``, and the documented behaviour past the training window.
"""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch

from attnres_dist import generation
from attnres_dist.config import load_config
from attnres_dist.data.tokenizer import ByteTokenizer, HFTokenizer
from attnres_dist.export import exported_tokenizer, generate, load_for_generation
from attnres_dist.hf.weights import split_qkv
from attnres_dist.hf.writer import write_hf_export
from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from tests.test_data import make_hf_tokenizer

TOL = 1e-5
BYTES = {"kind": "bytes", "vocab_size": 257, "eod": 256}
REACHED = os.environ.get("ATTNRES_TOLERANCE_LOG")  # optional: append reached diffs (JSONL)
CASES = {
    "baseline-tied": {"model.attnres.mode": "baseline"},
    "full-untied": {"model.attnres.mode": "full", "model.tie_embeddings": False},
    "block3-uneven-tied-gqa": {"model.attnres.block_size": 3, "model.num_query_groups": 2},
    "block3-uneven-untied": {"model.attnres.block_size": 3, "model.tie_embeddings": False},
    # each norm's epsilon times the square of its mix's source count (import-hf's models)
    "block3-uneven-scaled-eps": {
        "model.attnres.block_size": 3,
        "model.attnres.source_scaled_eps": True,
    },
    "full-scaled-eps": {"model.attnres.mode": "full", "model.attnres.source_scaled_eps": True},
    # Delta AttnRes: the mix added to the residual stream, no final mix
    "delta_full-untied": {"model.attnres.mode": "delta_full", "model.tie_embeddings": False},
    "delta_block3-uneven-tied-gqa": {
        "model.attnres.mode": "delta_block",
        "model.attnres.block_size": 3,
        "model.num_query_groups": 2,
    },
    "delta_block3-uneven-scaled-eps": {
        "model.attnres.mode": "delta_block",
        "model.attnres.block_size": 3,
        "model.attnres.source_scaled_eps": True,
    },
    "delta_full-scaled-eps": {
        "model.attnres.mode": "delta_full",
        "model.attnres.source_scaled_eps": True,
    },
    # mixture of experts (Megatron-Core's MoELayer): the first layer dense, a shared expert
    "block3-moe-shared-tied": {
        "model.attnres.block_size": 3,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.dense_layers": 1,
        "model.moe.expert_ffn_hidden_size": 40,
        "model.moe.shared_expert_ffn_hidden_size": 24,
    },
    # Qwen3's attention (wider heads, query and key norms) and Switch-style expert weights
    "block3-qk-norm-head16-moe-pre-softmax": {
        "model.attnres.block_size": 3,
        "model.num_query_groups": 2,
        "model.head_dim": 16,
        "model.qk_norm": True,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.router_pre_softmax": True,
        "model.moe.dense_layers": 1,
    },
    "full-moe-pattern-untied": {
        "model.attnres.mode": "full",
        "model.tie_embeddings": False,
        "model.moe.num_experts": 3,
        "model.moe.top_k": 1,
        "model.moe.pattern": "[1,0,1,0]",
    },
}


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_distributed(ParallelDims(), seed=0)


def build(overrides: dict, vocab: int = 257, seq_length: int = 16):
    """(AttnResGPT with random norm gains, queries and key gains, its ModelConfig)."""
    base = {
        "model.num_layers": 4,
        "model.hidden_size": 32,
        "model.num_attention_heads": 4,
        "model.seq_length": seq_length,
        "model.attnres.mode": "block",
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in {**base, **overrides}.items()])
    model = AttnResGPT(ModelBuilder(cfg.model, vocab)).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # the norms' gains
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 1.0)
            elif name.endswith("mixer_weights"):  # [mixers, (query, key gain), D]
                p[:, 0].copy_(torch.randn(p[:, 0].shape, generator=g))
                p[:, 1].copy_(torch.randn(p[:, 1].shape, generator=g) * 0.3 + 1.0)
    return model, cfg.model


def export(model, model_cfg, out, tokenizer=BYTES):
    tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    extra = {"model": {}, "tokenizer": tokenizer, "step": 0, "source": "test"}
    padded = model.embedding.word_embeddings.weight.shape[0]
    return write_hf_export(out, tensors, model_cfg, padded, tokenizer, extra)


def load_hf(out):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_the_single_process_model(case, tmp_path):
    model, model_cfg = build(CASES[case])
    out = export(model, model_cfg, tmp_path / "hf")
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "configuration_attnres.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_attnres.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnres" and "AutoModelForCausalLM" in config["auto_map"]
    weights = safetensors.torch.load_file(out / "model.safetensors")
    assert ("lm_head.weight" in weights) == (not model_cfg.tie_embeddings)
    assert all(k.startswith("model.") or k == "lm_head.weight" for k in weights)
    groups = model_cfg.num_query_groups or 4
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (
        model_cfg.kv_channels * groups,
        32,
    )
    hf = load_hf(out)
    assert type(hf).__name__ == "AttnResForCausalLM"
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(tokens).transpose(0, 1)  # [b, s, padded vocab]
        got = hf(tokens).logits
    assert got.shape == (2, 16, 257)  # padding rows sliced off
    diff = (got - ref[..., :257]).abs().max().item()
    if REACHED:
        with open(REACHED, "a") as f:
            f.write(json.dumps({"test": f"hf_logits[{case}]", "diff": diff, "tol": TOL}) + "\n")
    assert diff <= TOL, diff


@pytest.mark.parametrize(
    "case", ["delta_full-untied", "delta_block3-uneven-tied-gqa", "block3-moe-shared-tied"]
)
def test_generation_with_the_kv_cache_equals_without(case, tmp_path):
    model, model_cfg = build(CASES[case], seq_length=32)
    hf = load_hf(export(model, model_cfg, tmp_path / "hf"))
    prompt = torch.tensor([list(b"def main(")])
    kwargs = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 256}
    cached = hf.generate(prompt, use_cache=True, **kwargs)
    recomputed = hf.generate(prompt, use_cache=False, **kwargs)
    assert cached.tolist() == recomputed.tolist() and cached.shape[1] == prompt.shape[1] + 16
    with torch.no_grad():  # the last step's logits, cached, against the trainer's model
        ref = model(cached[:, :-1]).transpose(0, 1)[0, -1, :257]
        past = hf(cached[:, :-2], use_cache=True).past_key_values
        got = hf(cached[:, -2:-1], past_key_values=past, use_cache=True).logits[0, -1]
    assert (got - ref).abs().max().item() <= TOL


def test_qkv_split_follows_megatron_group_layout():
    # 4 query heads in 2 groups, head_dim 1: Megatron's rows are [q0 q1 k0 v0 | q2 q3 k1 v1]
    rows = ["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"]
    weight = torch.arange(8.0)[:, None] * torch.ones(1, 3)
    q, k, v = split_qkv(weight, heads=4, groups=2, head_dim=1)
    label = lambda t: [rows[int(r)] for r in t[:, 0]]
    assert (label(q), label(k), label(v)) == (["q0", "q1", "q2", "q3"], ["k0", "k1"], ["v0", "v1"])


@pytest.fixture(scope="module")
def gqa_export(tmp_path_factory):
    """(reference model, its HF export directory) with a 32-token window."""
    model, model_cfg = build(CASES["block3-uneven-tied-gqa"], seq_length=32)
    return model, export(model, model_cfg, tmp_path_factory.mktemp("gqa") / "hf")


def test_cached_logits_equal_recompute_at_every_step(gqa_export):
    model, out = gqa_export
    hf, info = load_for_generation(out)
    cached = generation.CachedDecoder(hf, seq_length=32)
    recompute = generation.RecomputeWindow(generation.native_forward(model), 32, "cpu")
    ids = ByteTokenizer().encode("def main(")
    with torch.no_grad():
        for _ in range(32 - len(ids)):
            a, b = cached(ids)[:257], recompute(ids)[:257]
            assert (a - b).abs().max().item() <= TOL
            ids.append(int(b.argmax()))
    assert cached.prefills == 1  # one prompt forward, then one position per token


def test_greedy_tokens_cached_recompute_and_transformers_generate(gqa_export):
    from transformers import AutoTokenizer

    model, out = gqa_export
    tok = ByteTokenizer()
    hf, _ = load_for_generation(out)
    prompt, new = "import os\n", 20  # 10 + 20 tokens: inside the 32-token window
    old = generate(model, tok, prompt, new, temperature=0, seq_length=32)  # AttnResGPT
    cached = generate(hf, tok, prompt, new, temperature=0, seq_length=32)
    recompute = generate(hf, tok, prompt, new, temperature=0, seq_length=32, kv_cache=False)
    assert old == cached == recompute and len(old) > 0
    sampled = [
        generate(m, tok, prompt, new, temperature=0.9, top_k=20, seed=5, seq_length=32)
        for m in (model, hf)
    ]
    assert sampled[0] == sampled[1]
    hf_tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    inputs = hf_tok(prompt, return_tensors="pt")
    ids = load_hf(out).generate(**inputs, max_new_tokens=new, do_sample=False, use_cache=True)
    assert hf_tok.decode(ids[0, inputs["input_ids"].shape[1] :]) == old


def test_left_padded_batch_equals_single_prompts(gqa_export):
    """Padding masks and positions as transformers' generate() passes them: a left-padded
    batch gives every prompt the logits and greedy tokens it gets alone."""
    model, out = gqa_export
    hf = load_hf(out)
    prompts = [list(b"def f(x):"), list(b"import")]
    width = max(map(len, prompts))
    ids = torch.tensor([[256] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batch = hf(input_ids=ids, attention_mask=mask).logits
        for row, p in enumerate(prompts):
            alone = model(torch.tensor([p])).transpose(0, 1)[0, :, :257]
            assert (batch[row, width - len(p) :] - alone).abs().max().item() <= TOL
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 256}
    together = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, width:].tolist()
    single = [hf.generate(torch.tensor([p]), **kwargs)[0, len(p) :].tolist() for p in prompts]
    assert together == single


def test_cached_decoder_past_the_window_rereads_the_newest_half(gqa_export):
    """Window 32: once full, the cache restarts from the newest 16 ids (positions 0..15)."""
    model, out = gqa_export
    hf, _ = load_for_generation(out)
    cached = generation.CachedDecoder(hf, seq_length=32)
    ids = ByteTokenizer().encode("x = ")
    starts = []
    with torch.no_grad():
        while len(ids) < 90:
            logits = cached(ids)[:257]
            starts.append(cached.start)
            window = torch.tensor([ids[cached.start :]])
            assert len(ids) - cached.start <= 32
            ref = model(window)[-1, 0, :257]
            assert (logits - ref).abs().max().item() <= TOL
            ids.append(int(ref.argmax()))
    # a window of 33 ids would not fit at 33, 50, 67 and 84 ids: keep the newest 16 each time
    assert sorted(set(starts)) == [0, 17, 34, 51, 68] and cached.prefills == 5


def test_byte_tokenizer_ids_match_the_project_tokenizer(gqa_export, tmp_path):
    from transformers import AutoTokenizer

    _, out = gqa_export
    hf_tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    ours = ByteTokenizer()
    texts = ["", "def f(x):\n\treturn x  # ok\r\n", "déjà vu ✓ 🎉 \u00a0", "a<|endoftext|>b"]
    for text in texts:
        ids = hf_tok(text)["input_ids"]
        assert ids == ours.encode(text) == list(text.encode("utf-8"))
        assert hf_tok.decode(ids) == text
    assert len(hf_tok) == 257 and hf_tok.convert_ids_to_tokens(256) == "<|endoftext|>"
    # declared end of text and padding: generate() stops there, padded batches need no patch
    assert hf_tok.eos_token_id == hf_tok.pad_token_id == 256
    batch = hf_tok(["ab", "abcd"], padding=True)["input_ids"]
    assert batch == [[97, 98, 256, 256], [97, 98, 99, 100]]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # any id sequence, invalid UTF-8 and end-of-document ids included
        ids = torch.randint(0, 257, (40,), generator=g).tolist()
        assert hf_tok.decode(ids) == ours.decode(ids)
    config = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == 256


def test_hf_tokenizer_is_copied_and_reproduces_training_ids(tmp_path):
    from transformers import AutoTokenizer

    path = make_hf_tokenizer(tmp_path / "tok.json")
    ours = HFTokenizer(path)
    model, model_cfg = build({}, vocab=ours.vocab_size)
    record = {"kind": "hf", "path": path, "vocab_size": ours.vocab_size, "eod": ours.eod}
    out = export(model, model_cfg, tmp_path / "hf", tokenizer=record)
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    hf_tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    for text in ["hello world\n", "déjà vu", "def f(x):\n    return x + 1\n"]:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert hf_tok.eos_token_id == ours.eod
    assert json.loads((out / "config.json").read_text())["vocab_size"] == ours.vocab_size
    hf, info = load_for_generation(out)
    assert exported_tokenizer(out, info).encode("hello") == ours.encode("hello")
    text = generate(hf, exported_tokenizer(out, info), "hello", 8, temperature=0, seq_length=16)
    assert text == generate(model, ours, "hello", 8, temperature=0, seq_length=16)
