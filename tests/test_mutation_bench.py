"""bench/mutations.py's list follows the code: every planted bug still applies (its old string is found exactly
once in its file), each names a description and the tests meant to catch it, and the names are unique. The
bench itself (each bug planted and its tests run) is in `make test-slow`."""

from __future__ import annotations

from bench.mutations import MUTATIONS, stale


def test_every_mutation_applies_exactly_once():
    assert len(MUTATIONS) >= 25
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    for m in MUTATIONS:
        assert stale(m) is None, (m.name, stale(m))
        assert m.old != m.new and m.what and m.tests, m.name
