"""What a mix with no expected mix assumes may come (issue #56): a pod that would take a whole node of each
class, ``UNSEEN_WEIGHT`` pods of each, weighed by scarcity like any kind and never counted as a pod."""

from __future__ import annotations

import pytest

from gpushared.core.placement.fragmentation import MAX_WHOLE_NODE_KINDS, NodeClass, RequestMix, node_room
from gpushared.core.placement.mixbook import UNSEEN_WEIGHT, ExpectedMix, MixBook
from gpushared.core.placement.policies import FGD, node_scores
from gpushared.core.placement.pricing import NodeCpu, PricingContext
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.core.shared.verdicts import judge
from tests.builders import inventory

G2 = NodeClass(model="G2", gpus=8, gpu_memory=16, cpu=96_000)
G3 = NodeClass(model="G3", gpus=8, gpu_memory=16, cpu=128_000)
T4 = NodeClass(model="T4", gpus=1, gpu_memory=15, cpu=32_000)


@pytest.mark.parametrize(
    ("nodes", "unseen", "kinds"),
    [
        ({G2: 30, G3: 2}, 4.0, {(128_000, 16, 8, None): 4.0}),  # a G3 covers a G2: the G3's alone
        ({G2: 30, T4: 2}, 4.0, {(96_000, 16, 8, None): 4.0}),
        # neither covers the other: a node of one GPU and 256 CPUs, one of 8 GPUs and 96
        (
            {G2: 30, T4._replace(gpu_memory=16, cpu=256_000): 2},
            1.0,
            {(96_000, 16, 8, None): 1.0, (256_000, 16, 1, None): 1.0},
        ),
        ({G2: 30, G3: 2}, 0.0, {}),  # none asked: none assumed
        ({}, 4.0, {}),  # the nodes not known: nothing to assume
        ({T4: 5, G2._replace(cpu=None): 3}, 1.0, {(32_000, 15, 1, None): 1.0}),  # CPU not known: no whole node
        ({G2._replace(gpus=0, gpu_memory=0): 3}, 1.0, {}),  # a node without GPUs takes no GPU kind
        ({G2: 3, G2._replace(model="A10"): 2}, 2.0, {(96_000, 16, 8, None): 2.0}),  # one shape, one kind
    ],
)
def test_whole_node_kinds_of_the_cluster(
    nodes: dict[NodeClass, int], unseen: float, kinds: dict[tuple[int, int, int, None], float]
) -> None:
    assert RequestMix(nodes=nodes, unseen=unseen).whole_node_kinds() == kinds


def test_the_shapes_assumed_are_bounded() -> None:
    """Work bounded by MAX_WHOLE_NODE_KINDS whatever the cluster: 100 shapes, none covering another (the more
    GPUs, the less CPU), give the 32 with the most GPUs; 500 that cover each other give the two no other does."""
    apart = {G2._replace(gpus=i, cpu=1000 * (1000 - i)): 1 for i in range(1, 101)}
    kinds = RequestMix(nodes=apart, unseen=1.0).whole_node_kinds()
    assert len(kinds) == MAX_WHOLE_NODE_KINDS
    assert sorted(gpus for _, _, gpus, _ in kinds) == list(range(101 - MAX_WHOLE_NODE_KINDS, 101))
    covered = {G2._replace(cpu=1000 * i, gpus=1 + i % 8): 1 for i in range(1, 501)}
    assert RequestMix(nodes=covered, unseen=1.0).whole_node_kinds() == {
        (495_000, 16, 8, None): 1.0,  # the most CPU of those with 8 GPUs
        (500_000, 16, 5, None): 1.0,  # the most CPU of all
    }


def test_whole_node_kinds_weigh_on_the_fragment_but_are_never_counted_as_pods() -> None:
    pinned = (4000, 8, 1, frozenset({"T4"}))
    counted = {(4000, 8, 1, None): 90.0, pinned: 10.0}
    plain = RequestMix.of_counts(counted, nodes={G2: 30, G3: 2, T4: 10})
    assumed = RequestMix.of_counts(counted, nodes={G2: 30, G3: 2, T4: 10}, unseen=5.0)
    assert len(assumed) == len(plain) == 100 and assumed.kinds() == plain.kinds()
    assert assumed.pressures() == plain.pressures() and assumed.projected_pressure("T4") == plain.projected_pressure(
        "T4"
    )
    # On a G3 node with one GPU broken, its whole-node kind (the one assumed: a G3 covers a G2 and a T4; only
    # the 2 G3s can host it, 42 / 2 = 21 times its 5 pods) cannot use any of the 7 empty GPUs left.
    broken = [16] * 7 + [8]
    extra = 5.0 * 21 * sum(broken) / (100 + 5.0)
    before = plain.for_node(G3).fragment(broken, cpu_free=120_000)
    assert assumed.for_node(G3).fragment(broken, cpu_free=120_000) == pytest.approx(before * 100 / 105 + extra)
    # With rooms known, a kind seen weighs by the nodes that could take it now; one assumed still by those
    # that could when empty: with no G3 left whole, its whole-node kind weighs 21 times, not 42.
    now = assumed.with_rooms({node_room(broken, model="G3", cpu_free=120_000): 2})
    plain_now = plain.with_rooms({node_room(broken, model="G3", cpu_free=120_000): 2})
    before_now = plain_now.for_node(G3).fragment(broken, cpu_free=120_000)
    assert now.unseen == 5.0
    assert now.for_node(G3).fragment(broken, cpu_free=120_000) == pytest.approx(before_now * 100 / 105 + extra)


def test_a_fresh_fgd_keeps_the_only_nodes_a_whole_node_kind_fits() -> None:
    """cpu200's failure (issue #56): a one-GPU pod of 16 CPUs is best balanced on the node of 8 GPUs and 128
    CPUs, and a fresh extender's fgd, knowing no kind yet, broke every such node before the first task of 8
    GPUs and 120 CPUs came. Assuming a whole node of each class may come, the node only it could take costs
    more to break than one of 96 CPUs, which a node of 128 could stand in for."""
    request = PodRequest(containers=(ContainerRequest("c0", 16),))

    def scores(unseen: float) -> list[int]:
        mix = MixBook(unseen=unseen).take(nodes={G2: 1, G3: 1})
        ranks = []
        for node in (G2, G3):
            ledger = Ledger.build(inventory(*[16] * 8))
            context = PricingContext(ledger, mix=mix, cpu=NodeCpu(node.cpu or 0, 0), pod_cpu=16_000, model=node.model)
            appraised = FGD.price_node(judge(ledger, request), request, context)
            ranks.append(None if appraised is None else appraised[0])
        return node_scores(ranks)

    g2, g3 = scores(0.0)
    assert g2 < g3  # no kind known: the balanced node, the only one that could host the big kind
    g2, g3 = scores(UNSEEN_WEIGHT)
    assert g2 > g3


def test_only_a_book_without_an_expected_mix_assumes_whole_nodes() -> None:
    assert MixBook().unseen == UNSEEN_WEIGHT
    assert MixBook(unseen=2.0).take(nodes={G2: 1}).unseen == 2.0
    expected = ExpectedMix.of_counts({(4000, 8, 1, None): 1})
    assert MixBook(expected).unseen == 0.0  # the operator said what to expect
    assert MixBook(ExpectedMix.of_counts({(4000, 8, 1, None): 1}, weight=0)).unseen == UNSEEN_WEIGHT


def test_the_extender_builds_its_mixes_with_the_whole_node_kinds() -> None:
    """Both ways the extender takes a mix, at once and off its event loop (``extender.mixing``)."""
    from gpushared.contract import ResourceNames
    from gpushared.extender.mixing import MixTaker
    from gpushared.extender.state import ClusterState

    assert ClusterState(resources=ResourceNames(), clock=lambda: 1000.0).request_mix().unseen == UNSEEN_WEIGHT
    book = MixBook()
    taker = MixTaker(book)
    try:
        taker.start(nodes={G2: 1}, rooms=None)
        building = taker._building
        assert building is not None
        building.result(timeout=30)  # built on the taker's thread; installed at the next look
        taker.collect()
    finally:
        taker.close()
    assert book.mix.unseen == UNSEEN_WEIGHT and book.mix.whole_node_kinds() == {(96_000, 16, 8, None): UNSEEN_WEIGHT}


def test_the_whole_node_kinds_are_found_once_per_mix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every class's view reads them: found per view, 5,000 classes of their own shapes cost 29 s a mix
    instead of 3 (bench/results/mix-build-5000-classes-issue56.json)."""
    from gpushared.core.placement import fragmentation

    calls = []
    found = fragmentation.whole_node_kinds
    monkeypatch.setattr(fragmentation, "whole_node_kinds", lambda *a: calls.append(a) or found(*a))
    nodes = {G2._replace(cpu=1000 * i): 1 for i in range(1, 51)}
    mix = RequestMix.of_counts({(4000, 8, 1, None): 10.0}, nodes=nodes, unseen=1.0)
    for node in nodes:
        mix.for_node(node)
    assert len(calls) == 1
