"""The benches' paired estimates (bench.paired), on hand-computed samples."""

from __future__ import annotations

import pytest

from bench.paired import (
    median_ratio,
    paired_difference,
    paired_interval,
    paired_ratio,
)


def test_a_slow_spell_cancels_in_the_paired_ratio_not_in_the_ratio_of_medians():
    # a takes 1.1x b's time; a slow spell (4x) starts between the two steps of repetition 2
    # and lasts to the end: one pair is off, while the medians compare a inside the spell with
    # b outside it
    a = [1.1, 1.1, 4.4, 4.4, 4.4]
    b = [1.0, 1.0, 1.0, 4.0, 4.0]
    assert paired_ratio(a, b) == pytest.approx(1.1)  # ratios 1.1, 1.1, 4.4, 1.1, 1.1
    assert median_ratio(a, b) == pytest.approx(4.4)


def test_paired_ratio_is_the_median_of_the_per_repetition_ratios():
    assert paired_ratio([2.0, 4.0, 20.0], [1.0, 10.0, 10.0]) == 2.0  # ratios 2, 0.4, 2
    assert median_ratio([2.0, 4.0, 20.0], [1.0, 10.0, 10.0]) == 0.4  # 4 / 10


def test_paired_difference_is_the_median_of_the_per_repetition_differences():
    # differences 1, 6, 7: median 6, where the medians' difference is 9 - 2 = 7
    assert paired_difference([2.0, 16.0, 9.0], [1.0, 10.0, 2.0]) == 6.0


def test_unpaired_samples_are_refused():
    with pytest.raises(ValueError, match="need equal, non-zero"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="need equal, non-zero"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="need equal, non-zero"):
        paired_ratio([], [])


def test_paired_interval_is_the_sign_test_interval_of_the_median():
    # n = 15: P(Binomial(15, 1/2) <= 3) = (1 + 15 + 105 + 455) / 2**15 = 576 / 32768, twice
    # that is 0.035 <= 0.05, while <= 4 adds 1365 (2 x 1941 / 32768 = 0.118): the 4th and 12th
    # smallest ratios, covering the median with probability 1 - 1152 / 32768
    ratios = [1.0 + i / 100 for i in (7, 3, 11, 0, 14, 5, 9, 1, 12, 6, 2, 13, 4, 10, 8)]
    low, high, coverage = paired_interval(ratios, [1.0] * 15)
    assert (low, high) == pytest.approx((1.03, 1.11))
    assert coverage == pytest.approx(1 - 1152 / 32768)


def test_paired_interval_needs_enough_repetitions():
    # n = 6: only the extremes, 1 - 2 / 64; n = 5: even they cover with 1 - 2 / 32 < 0.95
    low, high, coverage = paired_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0], [1.0] * 6)
    assert (low, high, coverage) == (1.0, 6.0, pytest.approx(62 / 64))
    assert paired_interval([1.0] * 5, [1.0] * 5) is None
    with pytest.raises(ValueError, match="need equal, non-zero"):
        paired_interval([1.0], [])
