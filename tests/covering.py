"""Pairwise covering arrays: every pair of factor levels in a few cases instead of the product.

``covering_cases(factors, allowed, cost)`` picks cases from the full product of the factors'
levels, greedily: each pick is the allowed case that covers the most pairs not yet covered, the
cheaper one (``cost``) on a tie, the earlier one in product order after that; it stops when
every pair that some allowed case holds is covered. ``pairs(factors)`` lists every pair of
levels of two different factors, ``covered_pairs(cases)`` the pairs some case holds: a test
compares the two, so a factor or level added later is covered too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

Pair = tuple[tuple[str, object], tuple[str, object]]


def pairs_of(case: dict) -> set[Pair]:
    """The pairs of (factor, level) one case holds, each ordered by factor name."""
    items = sorted(case.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def pairs(factors: dict[str, list]) -> set[Pair]:
    """Every pair of levels of two different factors."""
    names = sorted(factors)
    return {
        ((a, x), (b, y))
        for a, b in itertools.combinations(names, 2)
        for x in factors[a]
        for y in factors[b]
    }


def covered_pairs(cases: list[dict]) -> set[Pair]:
    return set().union(*(pairs_of(case) for case in cases)) if cases else set()


def covering_cases(
    factors: dict[str, list],
    allowed: Callable[[dict], bool] = lambda case: True,
    cost: Callable[[dict], float] = lambda case: 1.0,
) -> list[dict]:
    """A pairwise covering array of ``factors`` made of ``allowed`` cases (greedy)."""
    names = list(factors)
    candidates = [
        case
        for values in itertools.product(*(factors[n] for n in names))
        if allowed(case := dict(zip(names, values, strict=True)))
    ]
    uncovered = covered_pairs(candidates)  # pairs no allowed case holds cannot be asked for
    chosen: list[dict] = []
    while uncovered:
        best = max(candidates, key=lambda c: (len(pairs_of(c) & uncovered), -cost(c)))
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen
