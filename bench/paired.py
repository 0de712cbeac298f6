"""The ratio of two interleaved variants' step times, estimated pair by pair.

The benches run every variant once per repetition, in a rotating order, so the samples of one
repetition were taken seconds apart. A slow spell of the shared machine (another tenant, a
frequency change) lasts longer than that: it slows both steps of a repetition alike and
cancels in their ratio, whereas the ratio of the two medians may take its numerator and its
denominator from different spells. ``paired_ratio`` is the median over repetitions of the
within-repetition ratio; the benches also report the ratio of the medians beside it.

``paired_interval`` says how far that median can be trusted: a distribution-free confidence
interval for the median of the per-repetition ratios (order statistics of a sign test), so a
bench reads "1.04, 95% within [0.99, 1.08]" where one noisy run could be taken for a verdict.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over repetitions r of ``numerator[r] / denominator[r]`` (aligned samples)."""
    return statistics.median(_ratios(numerator, denominator))


def paired_interval(
    numerator: Sequence[float], denominator: Sequence[float], level: float = 0.95
) -> tuple[float, float, float] | None:
    """``(low, high, coverage)``: the order statistics ``r_(k) <= r_(n + 1 - k)`` of the n
    per-repetition ratios that hold their population median with probability ``coverage >=
    level`` (``1 - 2 P(Binomial(n, 1/2) < k)``, k as large as that allows); None when n is too
    small for any such k (n < 6 at 95%)."""
    ratios = sorted(_ratios(numerator, denominator))
    n = len(ratios)
    tail, k = 0.0, 0  # tail = P(B < k + 1) as k grows
    while k < n // 2:
        tail += math.comb(n, k) / 2**n
        if 2 * tail > 1 - level:
            break
        k += 1
    if k == 0:
        return None
    coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
    return ratios[k - 1], ratios[n - k], coverage


def paired_difference(minuend: Sequence[float], subtrahend: Sequence[float]) -> float:
    """Median over repetitions r of ``minuend[r] - subtrahend[r]`` (aligned samples): the
    extra time itself, where a ratio would fold in the size of the step."""
    _check(minuend, subtrahend)
    return statistics.median(a - b for a, b in zip(minuend, subtrahend, strict=True))


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The ratio of the two medians (what the paired estimate is reported beside)."""
    return statistics.median(numerator) / statistics.median(denominator)


def _check(a: Sequence[float], b: Sequence[float]) -> None:
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples: got {len(a)} and {len(b)}; need equal, non-zero")


def _ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    _check(numerator, denominator)
    return [a / b for a, b in zip(numerator, denominator, strict=True)]
