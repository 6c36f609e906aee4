"""The preempt verb's decision: which pods to evict so that a pod fits on one GPU (or on its GPUs)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.contract import ComputeShare, GpuInventory
from gpushared.core.placement import preemption
from gpushared.core.placement.preemption import (
    CHECK_BUDGET,
    Occupant,
    Victims,
    pdb_violations,
    select_victims,
)
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.core.shared.verdicts import MAX_MPS_CLIENTS, fitting
from tests.builders import inventory

HIGH = 100_000
#: a drawn node: its ledger, the pod, its priority, the occupants, the PDBs' disruptions left, MPS clients
Case = tuple[Ledger, PodRequest, int, dict[str, Occupant], dict[str, int], int]


def held(uid: str, gpus: Mapping[int, int], **extra: object) -> Holding:
    return Holding(uid=uid, namespace="default", name=uid, gpus=dict(gpus), **extra)  # type: ignore[arg-type]


def ask(amount: int, *, gpus: int = 1, mps: bool = False, compute: int | None = None) -> PodRequest:
    share = ComputeShare(request=compute) if compute is not None else None
    return PodRequest(containers=(ContainerRequest("c0", amount, gpus=gpus),), mps=mps, compute=share)


def low(*uids: str, priority: int = 0, pdbs: tuple[str, ...] = ()) -> dict[str, Occupant]:
    return {uid: Occupant(priority=priority, pdbs=pdbs) for uid in uids}


def issue_node() -> tuple[Ledger, dict[str, Occupant]]:
    """GPUs of 16, 12, 24 and 8 GiB; nine 6 GiB pods of priority 0: 12/16, 12/12, 24/24 and 6/8 used."""
    placed = {"g0-a": 0, "g0-b": 0, "g1-a": 1, "g1-b": 1, "g2-a": 2, "g2-b": 2, "g2-c": 2, "g2-d": 2, "g3-a": 3}
    ledger = Ledger.build(inventory(16, 12, 24, 8), [held(uid, {gpu: 6}) for uid, gpu in placed.items()])
    return ledger, low(*placed)


def test_the_issue_one_pod_on_the_gpu_with_room_goes() -> None:
    # kube-scheduler would evict any 6 GiB pod: only one on GPU 0 leaves 10 GiB there (GPU 3 has 8 in all)
    ledger, occupants = issue_node()
    victims = select_victims(ledger, ask(10), priority=HIGH, occupants=occupants)
    assert victims == Victims(uids=("g0-a",), gpus=(0,), highest_priority=0, pdb_violations=0)


def test_pods_of_equal_priority_are_never_victims() -> None:
    ledger, occupants = issue_node()
    assert select_victims(ledger, ask(10), priority=0, occupants=occupants) is None
    # GPU 0's pods are as important as the preemptor: two pods of GPU 1 go instead
    occupants |= low("g0-a", "g0-b", priority=5)
    victims = select_victims(ledger, ask(10), priority=5, occupants=occupants)
    assert victims is not None
    assert (victims.uids, victims.gpus) == (("g1-a", "g1-b"), (1,))


def test_two_low_pods_go_before_one_medium() -> None:
    ledger = Ledger.build(inventory(16), [held("low-a", {0: 4}), held("low-b", {0: 4}), held("medium", {0: 8})])
    occupants = low("low-a", "low-b", priority=1) | low("medium", priority=5)
    victims = select_victims(ledger, ask(8), priority=10, occupants=occupants)
    assert victims == Victims(uids=("low-a", "low-b"), gpus=(0,), highest_priority=1, pdb_violations=0)
    # the medium pod alone would do, but is more important than the two together
    assert select_victims(ledger, ask(8), priority=3, occupants=occupants) == victims


def test_the_fewest_victims_at_the_lowest_priority() -> None:
    # one large pod frees the room that three small ones would: it goes alone
    pods = [held("small-a", {0: 2}), held("small-b", {0: 2}), held("small-c", {0: 2}), held("large", {0: 6})]
    ledger = Ledger.build(inventory(12), pods)
    victims = select_victims(ledger, ask(6), priority=1, occupants=low("small-a", "small-b", "small-c", "large"))
    assert victims is not None
    assert victims.uids == ("large",)


def test_a_pod_on_two_gpus() -> None:
    pods = [held("x", {0: 6}), held("y", {1: 4}), held("z", {2: 6}), held("z2", {2: 2}), held("w", {3: 8})]
    ledger = Ledger.build(inventory(8, 8, 8, 8), pods)
    occupants = low("x", "y", "z", "z2", "w")
    victims = select_victims(ledger, ask(8, gpus=2), priority=1, occupants=occupants)
    # GPU 1 has room; one pod makes any other GPU fit: the lowest indexes win without links
    assert victims == Victims(uids=("x",), gpus=(0, 1), highest_priority=0, pdb_violations=0)
    # GPUs 1 and 2 joined by NVLink, the rest across sockets: z goes instead
    words = ("SYS", "SYS", "SYS", "NV2", "SYS", "SYS")
    linked = Ledger.build(dataclasses.replace(inventory(8, 8, 8, 8), links=words), pods)
    victims = select_victims(linked, ask(8, gpus=2), priority=1, occupants=occupants)
    assert victims is not None
    assert (victims.uids, victims.gpus) == (("z",), (1, 2))


def test_a_victim_on_two_gpus_frees_both_and_counts_once() -> None:
    ledger = Ledger.build(inventory(8, 8), [held("pair", {0: 8, 1: 8})])
    victims = select_victims(ledger, ask(16, gpus=2), priority=1, occupants=low("pair"))
    assert victims == Victims(uids=("pair",), gpus=(0, 1), highest_priority=0, pdb_violations=0)


def test_mps_and_plain_pods_do_not_share_a_gpu() -> None:
    # GPU 0 has room but two plain pods; GPU 1 one plain pod: an MPS pod evicts the one
    pods = [held("plain-a", {0: 2}), held("plain-b", {0: 2}), held("plain-c", {1: 12})]
    ledger = Ledger.build(inventory(16, 16, mps=True), pods)
    occupants = low("plain-a", "plain-b", "plain-c")
    victims = select_victims(ledger, ask(4, mps=True), priority=1, occupants=occupants)
    assert victims is not None
    assert (victims.uids, victims.gpus) == (("plain-c",), (1,))
    # a plain pod fits beside them already: no victim
    assert select_victims(ledger, ask(4), priority=1, occupants=occupants) == Victims((), (0,), None, 0)
    # and a plain pod evicts an MPS client, memory or not
    clients = Ledger.build(inventory(16, mps=True), [held("client", {0: 1}, mps=True)])
    victims = select_victims(clients, ask(4), priority=1, occupants=low("client"))
    assert victims is not None
    assert victims.uids == ("client",)


def test_the_mps_client_limit() -> None:
    ledger = Ledger.build(inventory(16, mps=True), [held("c1", {0: 1}, mps=True), held("c2", {0: 1}, mps=True)])
    occupants = low("c1") | low("c2", priority=1)
    victims = select_victims(ledger, ask(1, mps=True), priority=5, occupants=occupants, max_mps_clients=2)
    assert victims is not None
    assert victims.uids == ("c1",)
    assert select_victims(ledger, ask(1, mps=True), priority=5, occupants=occupants) == Victims((), (0,), None, 0)


def test_a_gpu_with_mps_clients_and_plain_pods() -> None:
    # one MPS client keeps the GPU serving MPS pods: a plain pod goes for memory, and the client stays
    pods = [held("plain-a", {0: 1}), held("plain-b", {0: 1}), held("client", {0: 1}, mps=True), held("vip", {0: 1})]
    ledger = Ledger.build(inventory(4, mps=True), pods)
    occupants = low("plain-a", "plain-b", "client") | low("vip", priority=2)
    victims = select_victims(ledger, ask(1, mps=True), priority=2, occupants=occupants, max_mps_clients=2)
    assert victims is not None
    assert victims.uids == ("plain-a",)
    # with the client gone the plain pods would have to go, and vip may not: the client is never a victim
    victims = select_victims(ledger, ask(2, mps=True), priority=2, occupants=occupants)
    assert victims is not None
    assert victims.uids == ("plain-a", "plain-b")


def test_compute_share() -> None:
    ledger = Ledger.build(inventory(16), [held("busy", {0: 2}, compute=80), held("big", {0: 4})])
    occupants = low("busy", "big")
    # 10 GiB are free, 20 percent of the compute: the pod that holds it goes
    victims = select_victims(ledger, ask(2, compute=50), priority=1, occupants=occupants)
    assert victims is not None
    assert victims.uids == ("busy",)
    assert select_victims(ledger, ask(2), priority=1, occupants=occupants) == Victims((), (0,), None, 0)


def test_pdbs_break_ties() -> None:
    ledger = Ledger.build(inventory(16), [held("a", {0: 8}), held("b", {0: 8})])
    occupants = low("a", pdbs=("web",)) | low("b")
    victims = select_victims(ledger, ask(8), priority=1, occupants=occupants, pdb_allowed={"web": 0})
    assert victims == Victims(uids=("b",), gpus=(0,), highest_priority=0, pdb_violations=0)
    # with a disruption left, the uid decides
    victims = select_victims(ledger, ask(8), priority=1, occupants=occupants, pdb_allowed={"web": 1})
    assert victims is not None
    assert (victims.uids, victims.pdb_violations) == (("a",), 0)
    # a violation that cannot be avoided is counted
    both = low("a", "b", pdbs=("web",))
    victims = select_victims(ledger, ask(16), priority=1, occupants=both, pdb_allowed={"web": 1})
    assert victims is not None
    assert (victims.uids, victims.pdb_violations) == (("a", "b"), 1)


def test_pdb_violations_are_counted_in_order() -> None:
    occupants = low("u1", "u2", pdbs=("x",)) | low("u3", pdbs=("x", "y")) | low("u4", pdbs=("gone",))
    assert pdb_violations(["u1", "u2"], occupants, {"x": 1}) == 1
    assert pdb_violations(["u1", "u2", "u3"], occupants, {"x": 2, "y": 5}) == 1
    assert pdb_violations(["u3"], occupants, {"x": 1, "y": 0}) == 1
    assert pdb_violations(["u4"], occupants, {"x": 0}) == 0  # a budget not known selects nothing


def test_no_set_makes_the_pod_fit() -> None:
    ledger, occupants = issue_node()
    assert select_victims(ledger, ask(25), priority=HIGH, occupants=occupants) is None
    assert select_victims(ledger, ask(12, gpus=5), priority=HIGH, occupants=occupants) is None
    assert select_victims(ledger, ask(0), priority=HIGH, occupants=occupants) is None
    # only GPU 2 holds 17 GiB, and its pods are as important as the preemptor
    occupants |= low("g2-a", "g2-b", "g2-c", "g2-d", priority=HIGH)
    assert select_victims(ledger, ask(17), priority=HIGH, occupants=occupants) is None


def test_what_can_never_go() -> None:
    # a pending pod's units stay counted on every GPU; a kept room and a pod without an occupant stay
    pods = [held("placed", {0: 6}), held("pending", {}, pending=6), held("kept", {1: 10}, kept=True), held("x", {1: 2})]
    ledger = Ledger.build(inventory(16, 16), pods)
    occupants = low("placed", "pending", "kept")
    victims = select_victims(ledger, ask(8), priority=1, occupants=occupants)
    assert victims is not None
    assert (victims.uids, victims.gpus) == (("placed",), (0,))
    assert select_victims(ledger, ask(12), priority=1, occupants=occupants) is None


def test_gpus_of_different_sizes() -> None:
    pods = [held("a", {0: 3}), held("a2", {0: 3}), held("b", {1: 6}), held("b2", {1: 6})]
    occupants = low("a", "a2", "b", "b2")
    # 2 GiB free of 8 on GPU 0, 4 of 16 on GPU 1: one pod frees enough on the larger GPU alone
    victims = select_victims(Ledger.build(inventory(8, 16), pods), ask(8), priority=1, occupants=occupants)
    assert victims is not None
    assert (victims.uids, victims.gpus) == (("b",), (1,))
    # the same pods on two 16 GiB GPUs: GPU 0 has room already
    equal = Ledger.build(inventory(16, 16), pods)
    assert select_victims(equal, ask(8), priority=1, occupants=occupants) == Victims((), (0,), None, 0)


def test_a_full_node_is_searched_within_the_bound() -> None:
    # 16 GPUs of 80 GiB, full, 48 pods of three priorities; beyond the exact search the answer still fits
    pods, occupants = [], {}
    for gpu in range(16):
        for slot, units in enumerate((40, 24, 16)):
            uid = f"p{gpu:02}-{slot}"
            pods.append(held(uid, {gpu: units}))
            occupants[uid] = Occupant(priority=(gpu + slot) % 3)
    ledger = Ledger.build(inventory(*[80] * 16), pods)
    request = ask(8 * 30, gpus=8)
    victims = select_victims(ledger, request, priority=10, occupants=occupants)
    assert victims is not None
    check_victims(ledger, request, victims, occupants=occupants, pdb_allowed={})
    assert victims.highest_priority == max(occupants[uid].priority for uid in victims.uids)
    # twenty small MPS clients on one GPU: too many subsets for the budget, the greedy search still finds five
    clients = [held(f"c{i:02}", {0: 1}, mps=True) for i in range(20)]
    assert CHECK_BUDGET < 2**20
    crowded = Ledger.build(inventory(20, mps=True), clients)
    victims = select_victims(crowded, ask(5, mps=True), priority=1, occupants=low(*(c.uid for c in clients)))
    assert victims is not None
    assert len(victims.uids) == 5


# Property: the answer fits, takes only lower-priority pods, spares none, and no set is better (brute force).


def fits(ledger: Ledger, request: PodRequest, gone: set[str], max_mps_clients: int) -> bool:
    rest = Ledger.build(ledger.inventory, [h for h in ledger.holdings() if h.uid not in gone])
    return len(fitting(rest, request, max_mps_clients=max_mps_clients)) >= request.gpus


def check_victims(
    ledger: Ledger,
    request: PodRequest,
    victims: Victims,
    *,
    occupants: Mapping[str, Occupant],
    pdb_allowed: Mapping[str, int],
    max_mps_clients: int = MAX_MPS_CLIENTS,
) -> None:
    gone = set(victims.uids)
    assert len(gone) == len(victims.uids)
    assert fits(ledger, request, gone, max_mps_clients)
    rest = Ledger.build(ledger.inventory, [h for h in ledger.holdings() if h.uid not in gone])
    assert set(victims.gpus) <= {v.gpu.index for v in fitting(rest, request, max_mps_clients=max_mps_clients)}
    assert len(victims.gpus) == request.gpus
    for uid in victims.uids:
        assert not fits(ledger, request, gone - {uid}, max_mps_clients), f"{uid} could be spared"
    ordered = sorted(victims.uids, key=lambda uid: (occupants[uid].priority, uid))
    assert list(victims.uids) == ordered
    assert victims.pdb_violations == count_violations(ordered, occupants, pdb_allowed)


def count_violations(uids: Sequence[str], occupants: Mapping[str, Occupant], allowed: Mapping[str, int]) -> int:
    """kube-scheduler's count, written out again: each victim takes one from every known budget selecting it."""
    left = dict(allowed)
    violating = 0
    for uid in uids:
        known = [name for name in occupants[uid].pdbs if name in left]
        if any(left[name] <= 0 for name in known):
            violating += 1
        for name in known:
            left[name] -= 1
    return violating


@st.composite
def nodes(draw: st.DrawFn) -> Case:
    sizes = draw(st.lists(st.integers(4, 12), min_size=1, max_size=4))
    base = inventory(*sizes)
    gpus = tuple(
        dataclasses.replace(gpu, mps_capable=draw(st.integers(0, 3)) > 0, healthy=draw(st.integers(0, 19)) > 0)
        for gpu in base.gpus
    )
    holdings, occupants = [], {}
    for i in range(draw(st.integers(0, 8))):
        uid = f"p{i}"
        kind = draw(st.sampled_from(["pod"] * 6 + ["kept", "pending", "stranger"]))
        on = draw(st.lists(st.integers(0, len(sizes) - 1), min_size=1, max_size=2, unique=True))
        mps = len(on) == 1 and draw(st.booleans())
        compute = draw(st.sampled_from([0, 0, 20, 50]))
        if kind == "pending":
            holding = held(uid, {}, pending=draw(st.integers(1, 4)), mps=mps, compute=compute)
        else:
            units = {index: draw(st.integers(1, 6)) for index in on}
            holding = held(uid, units, mps=mps, compute=compute, kept=kind == "kept")
        holdings.append(holding)
        if kind != "stranger":
            pdbs = tuple(draw(st.lists(st.sampled_from(["a", "b", "c"]), max_size=2, unique=True)))
            occupants[uid] = Occupant(priority=draw(st.integers(0, 3)), pdbs=pdbs)
    count = draw(st.integers(1, min(2, len(sizes))))
    mps = count == 1 and draw(st.booleans())
    compute = draw(st.sampled_from([None, 10, 40, 70]))
    request = ask(count * draw(st.integers(1, 8)), gpus=count, mps=mps, compute=compute)
    allowed = {"a": draw(st.integers(0, 2)), "b": draw(st.integers(0, 1))}
    ledger = Ledger.build(GpuInventory(unit=base.unit, gpus=gpus), holdings)
    return ledger, request, draw(st.integers(2, 4)), occupants, allowed, draw(st.sampled_from([1, 2, MAX_MPS_CLIENTS]))


def may_go(ledger: Ledger, priority: int, occupants: Mapping[str, Occupant]) -> list[str]:
    """The pods that may be victims, as the rules say: lower priority, an occupant, a GPU choice, not kept."""
    return sorted(
        (
            h.uid
            for h in ledger.holdings()
            if h.uid in occupants and occupants[h.uid].priority < priority and not h.kept and not h.pending and h.gpus
        ),
        key=lambda uid: (occupants[uid].priority, uid),
    )


def best_keys(case: Case) -> list[tuple[int, int, int, int]]:
    """(highest priority, PDB violations, victims, sum of priorities) of every set of pods that may go and
    makes the pod fit: all subsets, tried one by one."""
    ledger, request, priority, occupants, allowed, clients = case
    eligible = may_go(ledger, priority, occupants)
    keys = []
    for size in range(len(eligible) + 1):
        for subset in itertools.combinations(eligible, size):
            if fits(ledger, request, set(subset), clients):
                priorities = [occupants[uid].priority for uid in subset]
                violations = count_violations(subset, occupants, allowed)
                keys.append((max(priorities, default=-1), violations, len(subset), sum(priorities)))
    return keys


@settings(max_examples=200, deadline=None)
@given(nodes())
def test_victims_are_the_best_set_that_fits(
    case: Case,
) -> None:
    ledger, request, priority, occupants, allowed, clients = case
    victims = select_victims(
        ledger, request, priority=priority, occupants=occupants, pdb_allowed=allowed, max_mps_clients=clients
    )
    keys = best_keys(case)
    if victims is None:
        assert not keys
        return
    assert keys
    check_victims(ledger, request, victims, occupants=occupants, pdb_allowed=allowed, max_mps_clients=clients)
    assert all(occupants[uid].priority < priority for uid in victims.uids)
    assert set(victims.uids) <= set(may_go(ledger, priority, occupants))
    priorities = [occupants[uid].priority for uid in victims.uids]
    assert victims.highest_priority == (max(priorities) if priorities else None)
    got = (max(priorities, default=-1), victims.pdb_violations, len(priorities), sum(priorities))
    assert got == min(keys)


@settings(max_examples=100, deadline=None)
@given(nodes())
def test_beyond_the_budget_the_answer_still_fits_and_evicts_the_least_important(
    case: Case,
) -> None:
    # no fit checks for the exact search: every set of GPUs is searched greedily
    ledger, request, priority, occupants, allowed, clients = case
    with mock.patch.object(preemption, "CHECK_BUDGET", 0):
        victims = select_victims(
            ledger, request, priority=priority, occupants=occupants, pdb_allowed=allowed, max_mps_clients=clients
        )
    keys = best_keys(case)
    assert (victims is None) == (not keys)
    if victims is not None:
        check_victims(ledger, request, victims, occupants=occupants, pdb_allowed=allowed, max_mps_clients=clients)
        priorities = [occupants[uid].priority for uid in victims.uids]
        assert max(priorities, default=-1) == min(keys)[0]


@pytest.mark.parametrize("priority", [1, 2])
def test_the_callers_ledger_is_left_as_it_was(priority: int) -> None:
    ledger, occupants = issue_node()
    before = (ledger.version, [h.uid for h in ledger.holdings()], ledger.used(0))
    select_victims(ledger, ask(10), priority=priority, occupants=occupants)
    assert (ledger.version, [h.uid for h in ledger.holdings()], ledger.used(0)) == before
