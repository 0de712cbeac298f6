"""Every test file is in a tier (``tiers.py``), and every capability the fast tier promises
names fast tests that exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import tiers

TESTS = Path(__file__).parent


def test_every_test_file_is_in_a_tier():
    on_disk = {p.name for p in TESTS.glob("test_*.py")}
    assert sorted(on_disk - set(tiers.FILES)) == [], "assign these in tests/tiers.py"
    assert sorted(set(tiers.FILES) - on_disk) == [], "tests/tiers.py names files that are gone"
    assert sorted(set(tiers.HEAVY_FIRST) - on_disk) == [], "HEAVY_FIRST names files that are gone"


@pytest.mark.parametrize("capability", tiers.CAPABILITIES)
def test_each_capability_has_fast_tests(capability):
    for where in tiers.CAPABILITIES[capability]:
        file, _, name = where.partition("::")
        source = (TESTS / file).read_text()
        assert not name or f"def {name}(" in source, f"{where}: no such test"
        if name:
            entries = tiers.FILES[file]
            fast = entries == tiers.FAST or name in {e.split("[")[0] for e in entries}
            assert fast, f"{where} is not in the fast tier"
        else:
            assert tiers.FILES[file] == tiers.FAST, f"{file} is not fast as a whole"


def test_tier_matching():
    assert tiers.matches("test_a", "test_a[x-y]")
    assert tiers.matches("test_a[x-y]", "test_a[x-y]")
    assert not tiers.matches("test_a[x-y]", "test_a[x-z]")
    assert not tiers.matches("test_a", "test_ab")
