"""The benches' paired ratio estimate (attnres_dist.bench.paired), on hand-computed samples."""

from __future__ import annotations

import pytest

from attnres_dist.bench.paired import median_ratio, paired_ratio


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


def test_unpaired_samples_are_refused():
    with pytest.raises(ValueError, match="need equal, non-zero"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="need equal, non-zero"):
        paired_ratio([], [])
