"""The ratio of two interleaved variants' step times, estimated pair by pair.

The benches run every variant once per repetition, in a rotating order, so the samples of one
repetition were taken seconds apart. A slow spell of the shared machine (another tenant, a
frequency change) lasts longer than that: it slows both steps of a repetition alike and
cancels in their ratio, whereas the ratio of the two medians may take its numerator and its
denominator from different spells. ``paired_ratio`` is the median over repetitions of the
within-repetition ratio; the benches also report the ratio of the medians beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over repetitions r of ``numerator[r] / denominator[r]`` (aligned samples)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(
            f"paired samples: got {len(numerator)} and {len(denominator)}; need equal, non-zero"
        )
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The ratio of the two medians (what the paired estimate is reported beside)."""
    return statistics.median(numerator) / statistics.median(denominator)
