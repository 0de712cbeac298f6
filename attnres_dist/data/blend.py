"""The data options in Megatron's words: a weighted blend of dataset prefixes and a split string.

``data.paths`` is a blend, written like Megatron's ``--data-path``: ``[w1, prefix1, w2, prefix2]``
(weights are numbers or numeric strings), or as a list of ``{path: ..., weight: ...}`` mappings;
a single prefix needs no weight. ``data.split`` is Megatron's train/valid/test split string
(``"969,30,1"``): up to three non-negative weights, normalised to shares of each dataset's
documents. Both are parsed here, with one-line ``ConfigError``\\ s, before anything is opened; this
module imports nothing heavy, so config validation can call it.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnres_dist.errors import ConfigError

BLEND_HINT = "write [weight, prefix, weight, prefix, ...] or a list of {path, weight}"
SPLIT_HINT = 'use up to three comma-separated weights for train,valid,test, e.g. "969,30,1"'


@dataclass(frozen=True)
class Blend:
    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None  # None: a single prefix, nothing to weigh


def _weight(value, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(where, f"weight {value!r} is not a number; {BLEND_HINT}")
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise ConfigError(where, f"weight {value!r} is not a number; {BLEND_HINT}") from None
    if not weight > 0 or weight == float("inf"):
        raise ConfigError(where, f"weight {value!r} must be a finite number > 0; {BLEND_HINT}")
    return weight


def _prefix(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(where, f"prefix {value!r} is not a path; {BLEND_HINT}")
    return value.strip()


def parse_blend(paths: list, where: str = "data.paths") -> Blend:
    """The blend ``paths`` describes (see the module docstring)."""
    if not isinstance(paths, list) or not paths:
        raise ConfigError(where, f"got {paths!r}; {BLEND_HINT}")
    if all(isinstance(item, dict) for item in paths):
        prefixes, weights = [], []
        for i, item in enumerate(paths):
            unknown = sorted(set(item) - {"path", "weight"})
            if unknown or "path" not in item:
                raise ConfigError(f"{where}[{i}]", f"got {item!r}; {BLEND_HINT}")
            prefixes.append(_prefix(item["path"], f"{where}[{i}]"))
            weights.append(_weight(item.get("weight", 1.0), f"{where}[{i}]"))
    elif len(paths) == 1:
        return Blend((_prefix(paths[0], f"{where}[0]"),), None)
    else:
        if len(paths) % 2:
            raise ConfigError(
                where, f"has {len(paths)} entries, not weight/prefix pairs; {BLEND_HINT}"
            )
        weights = [_weight(paths[i], f"{where}[{i}]") for i in range(0, len(paths), 2)]
        prefixes = [_prefix(paths[i], f"{where}[{i}]") for i in range(1, len(paths), 2)]
    if len(set(prefixes)) != len(prefixes):
        raise ConfigError(where, f"names a prefix twice ({prefixes}); give each dataset once")
    if len(prefixes) == 1:
        return Blend(tuple(prefixes), None)
    return Blend(tuple(prefixes), tuple(weights))


def parse_split(split: str, where: str = "data.split") -> tuple[float, float, float]:
    """Normalised (train, valid, test) shares of a split string; training and validation must
    both get a share."""
    parts = [p.strip() for p in str(split).split(",")]
    if not 1 <= len(parts) <= 3:
        raise ConfigError(where, f"got {split!r}; {SPLIT_HINT}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(where, f"got {split!r}; {SPLIT_HINT}") from None
    values += [0.0] * (3 - len(values))
    if any(not v >= 0 or v == float("inf") for v in values):
        raise ConfigError(where, f"got {split!r}; weights must be finite and >= 0")
    if values[0] <= 0 or values[1] <= 0:
        raise ConfigError(
            where, f"got {split!r}; training and validation both need a share > 0, e.g. 98,2,0"
        )
    total = sum(values)
    return tuple(v / total for v in values)
