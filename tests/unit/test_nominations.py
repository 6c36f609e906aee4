"""The room preemption freed, held for its preemptor (``extender.nominations``): filter and bind judge a pod
that does not outrank the preemptor with the held room counted, memory and compute alike; the preemptor
itself gets its offered GPUs."""

from __future__ import annotations

from typing import Any

from gpushared import contract
from gpushared.core.placement.nodes import NodeState
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.requests import pod_request
from gpushared.core.shared.verdicts import judge
from gpushared.extender.nominations import Nominations, Offer
from tests.builders import inventory, pod

INV = inventory(16, 16)


def asking(name: str, gib: int, *, priority: int, compute: int = 0, nominated: str = "") -> dict[str, Any]:
    body = pod(name, gib, annotations={contract.POD_COMPUTE_REQUEST: str(compute)} if compute else None)
    body["metadata"]["uid"] = name
    body["spec"]["priority"] = priority
    if nominated:
        body["status"]["nominatedNodeName"] = nominated
    return body


def world(*pending: dict[str, Any]) -> Nominations:
    nodes = {"n": NodeState("n", inventory=INV, ledger=Ledger.build(INV))}
    nominations = Nominations(lambda: list(pending), nodes, clock=lambda: 100.0)
    nominations.offer("high", "n", Offer((0,), per_gpu=8, compute=80, priority=1000, at=99.0))
    return nominations


def test_the_held_room_is_counted_for_pods_that_do_not_outrank_the_preemptor() -> None:
    high = asking("high", 8, priority=1000, compute=80, nominated="n")
    nominations = world(high)
    small = asking("small", 4, priority=0)
    assert nominations.fits("n", small, pod_request(small))  # 8 GiB and 20 % left on GPU 0, all of GPU 1
    big = asking("big", 12, priority=1000)  # equal priority: the hold is the preemptor's
    assert nominations.fits("n", big, pod_request(big))  # GPU 1
    greedy = asking("greedy", 12, priority=0)
    verdicts = nominations.verdicts("n", greedy, judge(Ledger.build(INV), pod_request(greedy)), pod_request(greedy))
    assert [v.fits for v in verdicts] == [False, True]  # bind keeps it off GPU 0


def test_compute_held_is_held_at_bind_as_at_filter() -> None:
    high = asking("high", 8, priority=1000, compute=80, nominated="n")
    nominations = world(high)
    hungry = asking("hungry", 4, priority=0, compute=30)
    request = pod_request(hungry)
    verdicts = nominations.verdicts("n", hungry, judge(Ledger.build(INV), request), request)
    assert [v.fits for v in verdicts] == [False, True]  # 20 % of GPU 0's compute is left, it asks 30


def test_the_preemptor_gets_its_offered_gpu_and_a_pod_that_outranks_it_ignores_the_hold() -> None:
    high = asking("high", 8, priority=1000, compute=80, nominated="n")
    nominations = world(high)
    request = pod_request(high)
    assert [v.gpu.index for v in nominations.verdicts("n", high, judge(Ledger.build(INV), request), request)] == [0]
    top = asking("top", 16, priority=2000)
    assert nominations.fits("n", top, pod_request(top))


def test_a_hold_lasts_only_while_its_preemptor_waits_nominated_there() -> None:
    moved = asking("high", 8, priority=1000, compute=80, nominated="elsewhere")
    nominations = world(moved)
    greedy = asking("greedy", 12, priority=0)
    assert nominations.held("n", for_pod=greedy) == []
    nominations = world()  # the preemptor bound or gone: nothing pending
    nominations.prune()
    assert nominations.offers == {}
