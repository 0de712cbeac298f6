"""Checkpoints written before each layer's depth mixers were packed into one parameter.

A layer's two mixers (the attention's and the MLP's) were four parameters,
``layers.N.attn_mixer.query``, ``layers.N.attn_mixer.key_norm_weight``,
``layers.N.mlp_mixer.query`` and ``layers.N.mlp_mixer.key_norm_weight``, and the final
aggregation's two, ``final.mixer.query`` and ``final.mixer.key_norm_weight``. They are now
``layers.N.mixer_weights`` ``[2, 2, D]`` and ``final.mixer_weights`` ``[1, 2, D]`` (row: the
mixer; column: query, key gain). ``PackedIndex`` reads such a checkpoint's tensors (the
parameter and each AdamW state entry) under the packed names, stacked; a scalar state entry
(AdamW's step, the same for every part) is taken from the first part.
"""

from __future__ import annotations

import re

import torch

_PART = re.compile(
    r"^(?P<head>(?:model|optim/[^/]+)/(?:layers\.\d+\.|final\.))"
    r"(?P<mixer>attn_mixer|mlp_mixer|mixer)\.(?P<column>query|key_norm_weight)$"
)
_ROW = {"attn_mixer": 0, "mlp_mixer": 1, "mixer": 0}
_COLUMN = {"query": 0, "key_norm_weight": 1}


class PackedIndex:
    """The packed keys an older checkpoint's index holds as parts: ``parts[key]`` is
    ``{(row, column): part key}``."""

    def __init__(self, index):
        self.parts: dict[str, dict[tuple[int, int], str]] = {}
        for key in index:
            match = _PART.match(key)
            if match is not None:
                packed = match["head"] + "mixer_weights"
                where = (_ROW[match["mixer"]], _COLUMN[match["column"]])
                self.parts.setdefault(packed, {})[where] = key

    def names(self, key: str) -> str:
        """``key`` under its packed name (itself where it is not a part)."""
        match = _PART.match(key)
        return key if match is None else match["head"] + "mixer_weights"

    def read(self, key: str, get) -> torch.Tensor | None:
        """The packed tensor ``key`` from its parts (``get(part key)``), or None where this
        checkpoint has no parts for it."""
        parts = self.parts.get(key)
        if parts is None:
            return None
        rows = 1 + max(r for r, _ in parts)
        if set(parts) != {(r, c) for r in range(rows) for c in (0, 1)}:
            return None
        first = get(parts[(0, 0)])
        if first.dim() == 0:  # AdamW's step count, the same for every part
            return first
        return torch.stack([torch.stack([get(parts[(r, c)]) for c in (0, 1)]) for r in range(rows)])
