"""The request mix kept as sums (core.placement.prefixsums) answers as its table does (issue #52, item 2): property
tests against brute force and against the table, and the build's cost growing as k log k, not k²."""

from __future__ import annotations

import gc
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.core.placement import fragmentation
from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.prefixsums import PrefixSums

items = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40), st.floats(0, 100, allow_nan=False)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(items=items, cpu=st.one_of(st.none(), st.integers(-1, 45)), low=st.integers(-1, 45), high=st.integers(-1, 45))
def test_a_sum_is_what_brute_force_counts(
    items: list[tuple[int, int, float]], cpu: int | None, low: int, high: int
) -> None:
    sums = PrefixSums(items)
    expected = sum(n for c, s, n in items if (cpu is None or c <= cpu) and low < s <= high)
    assert sums.total(cpu, above=low, upto=high) == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert sums.total(cpu) == pytest.approx(sum(n for c, _, n in items if cpu is None or c <= cpu), abs=1e-9)


kinds = st.dictionaries(
    st.tuples(st.integers(0, 8), st.integers(0, 24), st.sampled_from([1, 1, 2, 4])),
    st.floats(0.5, 50, allow_nan=False),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    counts=kinds,
    frees=st.lists(st.integers(0, 24), min_size=1, max_size=8),
    cpu=st.one_of(st.none(), st.integers(0, 9)),
)
def test_the_mix_as_sums_prices_every_node_as_its_table_does(
    counts: dict[tuple[int, int, int], float], frees: list[int], cpu: int | None
) -> None:
    table = RequestMix.of_counts(counts).fragment(frees, cpu_free=cpu)
    cells, groups = fragmentation.TABLE_CELLS, fragmentation.GANG_GROUPS
    try:
        fragmentation.TABLE_CELLS = fragmentation.GANG_GROUPS = -1  # every mix as sums
        summed = RequestMix.of_counts(counts).fragment(frees, cpu_free=cpu)
    finally:
        fragmentation.TABLE_CELLS, fragmentation.GANG_GROUPS = cells, groups
    assert summed == pytest.approx(table, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("n", [1_000, 10_000])
def test_what_the_mix_keeps_grows_as_k_log_k(n: int) -> None:
    """10,000 distinct kinds once cost 1.4 GiB and a minute of the event loop: a row per CPU value, every
    size in each (k² cells). Counted, not timed: the sums hold one path of log k nodes per kind."""
    rng = random.Random(n)
    counts = {
        (rng.randrange(96_000), rng.randrange(1, 100_000), rng.choice([1, 1, 1, 2, 4, 8]), None): rng.random()
        for _ in range(n)
    }
    mix = RequestMix.of_counts(counts)
    assert mix._sums is not None and not mix._rows  # past the table's budget
    nodes = len(mix._sums._sum) + sum(len(s._sum) for s in mix._gang_sums.values())
    assert nodes <= n * (math.ceil(math.log2(n)) + 2) + 1 + len(mix._gang_sums), nodes


def test_the_tree_is_kept_where_the_garbage_collector_does_not_walk() -> None:
    """A full collection walks every element of a tracked list: the trees of one mix of 2,000 MiB-sized kinds
    (a tree per node class) held whichever thread collected, the event loop's or the mix builder's, for
    30-75 ms (issue #52). In typed arrays each is one object the collector does not look into."""
    rng = random.Random(3)
    sums = PrefixSums((rng.randrange(96_000), rng.randrange(1, 100_000), rng.random()) for _ in range(10_000))
    walked = {name: len(gc.get_referents(value)) for name, value in vars(sums).items()}
    assert walked and max(walked.values()) <= 1, walked  # an array refers to its type at most
