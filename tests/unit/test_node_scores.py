"""From nodes' ranks to kube-scheduler's scores: the top score for the cheapest, links first, as written."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.core.placement.policies import (
    EQUAL_PRICE,
    MAX_SCORE,
    SPREAD,
    TIEBREAK,
    NodeRank,
    best_nodes,
    node_scores,
)
from gpushared.core.shared.ledger import Ledger
from tests.builders import inventory
from tests.placing import appraised, request, used


@pytest.mark.parametrize(
    "keys",
    [
        [None, NodeRank(3.0), NodeRank(4.0), NodeRank(3.0 + 1e-12), None],
        [NodeRank(1.0, 0.5), NodeRank(1.0, 0.2), NodeRank(2.0), NodeRank(1.0, 0.2)],
        [NodeRank(5.0, links=-400), NodeRank(1.0, links=-200), NodeRank(2.0, links=-400)],
        [None, None],
        [],
        [NodeRank(7.0)],
    ],
)
def test_best_nodes_are_the_ones_scored_highest(keys: list[NodeRank | None]) -> None:
    """What --rank-in-filter keeps is what prioritize gives the top score: the same choice for kube-scheduler."""
    top = [i for i, score in enumerate(node_scores(keys)) if score == MAX_SCORE and keys[i] is not None]
    assert best_nodes(keys) == top


def plain_scores(keys: list[NodeRank | None]) -> list[int]:
    """node_scores' rules as written in its docstring, one step at a time: what the one-pass version in
    core/placement/policies.py must always agree with."""
    known = [k for k in keys if k is not None]
    if not known:
        return [0] * len(keys)
    eq = EQUAL_PRICE
    links = min(k.links for k in known)
    cheapest = min(k.price for k in known if k.links <= links + eq)
    tiebreak = min(k.tiebreak for k in known if k.links <= links + eq and k.price <= cheapest + eq)
    linked = {i: k for i, k in enumerate(keys) if k is not None and k.links <= links + eq}
    worst = max(k.price for k in linked.values())
    scores: dict[int, int] = {}
    for i, k in linked.items():
        if k.price <= cheapest + eq and k.tiebreak <= tiebreak + eq:
            scores[i] = MAX_SCORE
        elif k.price <= cheapest + eq:
            scores[i] = MAX_SCORE - 1
        else:
            scores[i] = math.floor((MAX_SCORE - 1) * (worst - k.price) / (worst - cheapest) + eq)
    lowest = min(scores.values())
    worst_links = max(k.links for k in known)
    for i, k in enumerate(keys):
        if k is not None and i not in linked:
            scores[i] = min(lowest, math.floor((MAX_SCORE - 1) * (worst_links - k.links) / (worst_links - links)))
    return [scores.get(i, 0) for i in range(len(keys))]


#: Ranks as policies produce them: prices and tiebreaks that tie often (equal nodes), some only up to float
#: sums; links of multi-GPU sets.
RANKS = st.lists(
    st.none()
    | st.builds(
        NodeRank,
        st.sampled_from([0.0, 1.0, 1.0 + 1e-12, 2.5, 7.0]) | st.floats(-1e6, 1e6, allow_nan=False),
        st.sampled_from([0.0, 0.2, 0.5]) | st.floats(0, 1),
        st.sampled_from([0.0, 0.0, -100.0, -400.0, -400.0 + 1e-12]),
    ),
    max_size=40,
)


@settings(max_examples=500, deadline=None)
@given(RANKS)
def test_scores_follow_the_rules_as_written(keys: list[NodeRank | None]) -> None:
    assert node_scores(keys) == plain_scores(keys)
    assert best_nodes(keys) == [i for i, k in enumerate(keys) if k is not None and node_scores(keys)[i] == MAX_SCORE]


def test_scores_give_the_top_only_to_the_cheapest_nodes() -> None:
    tight = Ledger.build(inventory(16))
    used(tight, 0, 10)
    roomy = Ledger.build(inventory(16))
    req = request(4)
    binpack = [appraised(ledger, req) for ledger in (tight, roomy, tight)]
    # What the node has left in GPUs (its CPU not known here), then a hair of the GPU's own leftover.
    assert binpack == [NodeRank(2 / 16 + TIEBREAK * 2 / 17), NodeRank(12 / 16 + TIEBREAK * 12 / 17), binpack[0]]
    assert node_scores(binpack) == [10, 0, 10]
    spread = [appraised(ledger, req, policy=SPREAD) for ledger in (tight, roomy)]
    assert node_scores(spread) == [0, 10]
    assert appraised(tight, request(7)) is None
    costs = [None, 3.0, 4.0, 4.0 + 1e-12, 12.0, None]
    assert node_scores([None if c is None else NodeRank(c) for c in costs]) == [0, 10, 8, 8, 0, 0]
    assert node_scores([NodeRank(1.0), NodeRank(1.0 + 1e-12)]) == [10, 10]  # equal, up to float sums
    assert node_scores([None, None]) == [0, 0]
    # At the best price, the better balanced node alone gets the top score; the others stay below both.
    assert node_scores([NodeRank(1.0, 0.5), NodeRank(1.0, 0.2), NodeRank(2.0), NodeRank(5.0)]) == [9, 10, 6, 0]
    # Better linked first, whatever the price; the less well linked never above the best-linked's lowest.
    linked = [NodeRank(5.0, links=-400), NodeRank(1.0, links=-200), NodeRank(2.0, links=-400), NodeRank(1.0, links=-20)]
    assert node_scores(linked) == [0, 0, 10, 0]
    assert node_scores([NodeRank(1.0, links=-400), NodeRank(9.0, links=-400), NodeRank(1.0, links=-200)]) == [10, 0, 0]
    assert node_scores([NodeRank(1.0, links=-400), NodeRank(1.0, links=-300), NodeRank(1.0, links=-100)]) == [10, 6, 0]
