"""Tokenizers: raw UTF-8 bytes, or a Hugging Face ``tokenizer.json``.

Both expose the same small interface the rest of the package relies on: ``name``, ``path``,
``vocab_size``, ``eod`` (the end-of-document id written after every document),
``encode(text) -> list[int]`` (no EOD appended) and ``decode(ids) -> str`` (EOD skipped).
``name`` and ``path`` are stored in the dataset metadata so ``build_tokenizer(name, path)``
recreates the tokenizer a dataset was written with.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from attnres_dist.errors import DataError

# Tried in order when no explicit EOD token is given: GPT-2 style, Llama 3's, then
# SentencePiece/T5 style.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class ByteTokenizer:
    """Token ids 0..255 are the UTF-8 bytes of the text; id 256 ends a document."""

    name = "bytes"
    path = None
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        # surrogatepass: lone surrogates (possible in JSON input) must not abort a whole run.
        return list(text.encode("utf-8", errors="surrogatepass"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` model loaded from a ``tokenizer.json`` file."""

    name = "hf"

    def __init__(self, path: str, eod_token: str | None = None):
        from tokenizers import Tokenizer

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise DataError(
                self.path,
                "tokenizer file not found; pass the path of a Hugging Face tokenizer.json "
                "(--tokenizer-path / data.tokenizer_path)",
            )
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(
                self.path, f"not a valid Hugging Face tokenizer.json ({msg}); re-export it"
            ) from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eod = self._find_eod(eod_token)

    def _find_eod(self, eod_token: str | None) -> int:
        candidates = (eod_token,) if eod_token is not None else EOD_CANDIDATES
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        if eod_token is not None:
            raise DataError(
                self.path,
                f"end-of-document token {eod_token!r} is not in the vocabulary; "
                "pass a token the tokenizer has",
            )
        raise DataError(
            self.path,
            f"no end-of-document token: none of {', '.join(EOD_CANDIDATES)} is in the "
            "vocabulary; add one as a special token when training the tokenizer",
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        keep = [int(i) for i in ids if int(i) != self.eod and 0 <= int(i) < self.vocab_size]
        return self._tok.decode(keep, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


TOKENIZER_KINDS = ("bytes", "hf")


def build_tokenizer(kind: str, path: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer named ``kind`` ("bytes" or "hf"); "hf" needs ``path`` to a tokenizer.json."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "hf":
        if not path:
            raise DataError(
                "tokenizer",
                "kind 'hf' needs the path of a tokenizer.json; "
                "pass --tokenizer-path (or data.tokenizer_path)",
            )
        return HFTokenizer(path)
    raise DataError("tokenizer", f"unknown kind {kind!r}; use one of: {', '.join(TOKENIZER_KINDS)}")
