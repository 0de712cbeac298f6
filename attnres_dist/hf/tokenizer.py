"""The training tokenizer as files ``transformers.AutoTokenizer`` loads.

Bytes: a ``tokenizers`` BPE model whose vocabulary is the 256 byte-level characters (GPT-2's
byte-to-unicode map, id = byte value) with no merges, after a ``ByteLevel`` normaliser, so
every text encodes to exactly its UTF-8 bytes, as ``ByteTokenizer`` does. The end-of-document
id 256 is the vocabulary entry ``<|endoftext|>``, deliberately *not* an added (special) token:
added tokens are matched inside the input text, and the project's tokenizer never turns text
into id 256 (the literal string ``<|endoftext|>`` stays 13 bytes). Without merges BPE only
ever emits single characters, so 256 is reachable by id alone; a ``Replace`` decoder step
drops it when decoding, as ``ByteTokenizer.decode`` skips it. Invalid UTF-8 decodes to
U+FFFD like Python's ``errors="replace"``.

``tokenizer_config.json`` declares ``<|endoftext|>`` as ``eos_token`` and ``pad_token`` with
``split_special_tokens`` on, so transformers' ``generate`` stops at it and pads with it while the
literal string in a text still encodes to its bytes.

Hugging Face: the run's ``tokenizer.json`` is copied unchanged; its end-of-document token is
declared as ``eos_token`` and as ``pad_token`` (padded batches, transformers' pipelines).
The project encodes with ``add_special_tokens=False``: pass the same to a tokenizer whose
post-processor adds tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
BYTE_EOD_TOKEN = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from byte values to printable characters (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` with the ids of ``ByteTokenizer`` (256 = end of document)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab[BYTE_EOD_TOKEN] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.ByteLevel()
    tok.decoder = decoders.Sequence([decoders.Replace(BYTE_EOD_TOKEN, ""), decoders.ByteLevel()])
    return tok


def write_tokenizer(output: Path, tokenizer: dict, seq_length: int) -> int:
    """Write ``tokenizer.json`` + ``tokenizer_config.json``; return the end-of-document id.

    ``tokenizer``: the checkpoint's tokenizer record (``kind``, ``path``, ``vocab_size``, ...).
    """
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": seq_length,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.get("kind") == "hf":
        from tokenizers import Tokenizer

        from attnres_dist.data.tokenizer import HFTokenizer

        source = HFTokenizer(tokenizer["path"])  # a missing or broken file: one-line error
        shutil.copyfile(source.path, output / TOKENIZER)
        eod = int(tokenizer.get("eod") if tokenizer.get("eod") is not None else source.eod)
        # end of text, and the padding of padded batches (as Llama exports do)
        config["eos_token"] = config["pad_token"] = Tokenizer.from_file(source.path).id_to_token(
            eod
        )
    else:
        byte_tokenizer().save(str(output / TOKENIZER))
        eod = 256
        # declared as end of text and padding, so generate() stops and batches pad; a special
        # token is matched inside text unless special tokens are split: then the literal
        # string stays its 13 bytes, as the project's tokenizer encodes it
        config["eos_token"] = config["pad_token"] = BYTE_EOD_TOKEN
        config["split_special_tokens"] = True
    (output / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return eod
