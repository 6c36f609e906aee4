"""The claim allocator's preemption, decided: which pods to evict so that a gated pod's claims fit, with claims
held by the pods they are reserved for (groups of pods that share claims go together)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.contract import MemoryUnit
from gpushared.core.placement.claims.asks import ClaimAsk, DeviceAsk
from gpushared.core.placement.claims.preemption import ClaimPod, ClaimVictims, claim_victims, claims_request
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import PodRequest
from gpushared.core.shared.verdicts import fitting
from tests.builders import inventory

GI = 2**30
HIGH, LOW, MID = 100_000, 0, 1_000


def device(claim: str, gpu: int, units: int, *, compute: int = 0, mps: bool = False, n: int = 0) -> Holding:
    """One allocated device of a claim, named as ``core.dra.allocated.claim_holdings`` names it."""
    return Holding(
        uid=f"{claim}/gpu/dev-{gpu}-{n}",
        namespace="default",
        name=f"resourceclaim/{claim}",
        gpus={gpu: units},
        mps=mps,
        assigned=True,
        compute=compute,
    )


def ask(memory_gib: int, *, count: int = 1, compute: int = 0, mps: bool = False, linked: bool = False) -> ClaimAsk:
    return ClaimAsk(
        namespace="default",
        name="wanted",
        uid="wanted-uid",
        resource_version="1",
        requests=(DeviceAsk("gpu", count, memory_gib * GI, compute),),
        linked=linked,
        mps=mps,
    )


def request(memory_gib: int, **kwargs: object) -> PodRequest:
    made = claims_request([ask(memory_gib, **kwargs)], MemoryUnit.GIB)  # type: ignore[arg-type]
    assert isinstance(made, PodRequest)
    return made


def issue_node() -> tuple[Ledger, dict[str, set[str]], dict[str, ClaimPod]]:
    """GPUs of 16, 12, 24 and 8 GiB; nine 6 GiB claims, each reserved for its own pod of priority LOW."""
    placed = {"g0-a": 0, "g0-b": 0, "g1-a": 1, "g1-b": 1, "g2-a": 2, "g2-b": 2, "g2-c": 2, "g2-d": 2, "g3-a": 3}
    ledger = Ledger.build(inventory(16, 12, 24, 8), [device(c, gpu, 6) for c, gpu in placed.items()])
    claims = {c: {f"pod-{c}"} for c in placed}
    pods = {f"pod-{c}": ClaimPod(LOW) for c in placed}
    return ledger, claims, pods


def decide(
    ledger: Ledger,
    claims: Mapping[str, set[str]],
    pods: Mapping[str, ClaimPod],
    wanted: PodRequest,
    *,
    priority: int = HIGH,
    published: set[int] | None = None,
) -> ClaimVictims | None:
    every = {gpu.index for gpu in ledger.inventory.gpus}
    return claim_victims(
        ledger,
        wanted,
        priority=priority,
        claims=claims,
        pods=pods,
        published=every if published is None else published,
    )


def test_the_pod_of_one_claim_on_the_gpu_with_room_goes() -> None:
    ledger, claims, pods = issue_node()
    assert decide(ledger, claims, pods, request(10)) == ClaimVictims(("pod-g0-a",), (0,), LOW, (LOW,))


@pytest.mark.parametrize(
    ("case", "change", "expected"),
    [
        ("equal priority is never a victim", {"priority": LOW}, None),
        (
            "a pod the cache does not show holds its claim",
            {"drop_pods": ("pod-g0-a", "pod-g0-b")},
            ("pod-g1-a", "pod-g1-b"),
        ),
        ("a claim reserved for no pod holds", {"unreserve": ("g0-a", "g0-b")}, ("pod-g1-a", "pod-g1-b")),
        ("an unpublished GPU is never given out", {"published": {1, 2, 3}}, ("pod-g1-a", "pod-g1-b")),
        ("only the 8 GiB GPU published", {"published": {3}}, None),
        ("the lower of two priorities goes first", {"raise": {"pod-g0-a": MID}}, ("pod-g0-b",)),
        ("a terminating pod's room is on its way: no one more", {"terminating": ("pod-g0-a",)}, ()),
        ("terminating elsewhere does not help GPU 0", {"terminating": ("pod-g2-a",)}, ("pod-g0-a",)),
    ],
)
def test_table(case: str, change: dict[str, object], expected: tuple[str, ...] | None) -> None:
    ledger, claims, pods = issue_node()
    priority = int(change.get("priority", HIGH))  # type: ignore[call-overload]
    for pod in change.get("drop_pods", ()):  # type: ignore[attr-defined]
        del pods[pod]
    for claim in change.get("unreserve", ()):  # type: ignore[attr-defined]
        claims[claim] = set()
    for pod, value in dict(change.get("raise", {})).items():  # type: ignore[call-overload]
        pods[pod] = ClaimPod(value)
    for pod in change.get("terminating", ()):  # type: ignore[attr-defined]
        pods[pod] = ClaimPod(LOW, terminating=True)
    published = change.get("published")
    found = decide(ledger, claims, pods, request(10), priority=priority, published=published)  # type: ignore[arg-type]
    if expected is None:
        assert found is None, case
    else:
        on = 1 if expected and expected[0].startswith("pod-g1") else 0  # GPU 1 (12 GiB) once both must go
        assert found is not None and found.pods == expected and found.gpus == (on,), (case, found)


def test_pods_sharing_a_claim_go_together() -> None:
    # one 12 GiB claim on GPU 0 of 16 GiB shared by two pods: both go, or the claim stays allocated
    ledger = Ledger.build(inventory(16), [device("shared", 0, 12)])
    found = decide(ledger, {"shared": {"a", "b"}}, {"a": ClaimPod(LOW), "b": ClaimPod(LOW)}, request(10))
    assert found is not None and found.pods == ("a", "b") and found.highest == LOW


def test_a_shared_claim_with_one_high_priority_pod_stays() -> None:
    ledger = Ledger.build(inventory(16), [device("shared", 0, 12)])
    assert decide(ledger, {"shared": {"a", "b"}}, {"a": ClaimPod(LOW), "b": ClaimPod(HIGH)}, request(10)) is None


def test_a_pod_with_two_claims_frees_both() -> None:
    # pod x holds 6 GiB on each of GPUs 0 and 1 (two claims); y holds 6 GiB on GPU 0. A 10 GiB pod on one GPU:
    # evicting x frees GPU 1 whole (12 GiB) with one victim
    ledger = Ledger.build(inventory(16, 12), [device("x0", 0, 6), device("x1", 1, 6), device("y", 0, 6)])
    claims = {"x0": {"x"}, "x1": {"x"}, "y": {"y"}}
    found = decide(ledger, claims, {"x": ClaimPod(LOW), "y": ClaimPod(LOW)}, request(10))
    assert found is not None and found.pods in (("x",), ("y",))
    assert len(found.pods) == 1


def test_compute_counts_as_memory_does() -> None:
    # GPU 0 has memory to spare but 80 % of its compute held; the 30 % pod frees it by evicting the 80 % claim
    ledger = Ledger.build(inventory(16, 16), [device("busy", 0, 2, compute=80), device("full", 1, 16)])
    claims = {"busy": {"p-busy"}, "full": {"p-full"}}
    found = decide(ledger, claims, {"p-busy": ClaimPod(LOW), "p-full": ClaimPod(LOW)}, request(4, compute=30))
    assert found is not None and found.pods == ("p-busy",) and found.gpus == (0,)


def test_mps_and_plain_claims_never_share_a_gpu() -> None:
    # an MPS claim asks; GPU 0 has a small plain claim (must go), GPU 1 a large MPS one (more than enough)
    ledger = Ledger.build(inventory(16, 16, mps=True), [device("plain", 0, 2), device("client", 1, 14, mps=True)])
    claims = {"plain": {"p"}, "client": {"c"}}
    found = decide(ledger, claims, {"p": ClaimPod(LOW), "c": ClaimPod(LOW)}, request(8, mps=True))
    assert found is not None and found.pods == ("p",) and found.gpus == (0,)


def test_a_group_one_holding_cannot_stand_for_holds() -> None:
    # a pod's two claims on GPUs 0 and 1 with different compute shares: evicting it is not weighed
    ledger = Ledger.build(inventory(16, 16), [device("a", 0, 16, compute=10), device("b", 1, 16, compute=20)])
    assert decide(ledger, {"a": {"x"}, "b": {"x"}}, {"x": ClaimPod(LOW)}, request(8)) is None


@pytest.mark.parametrize(
    ("asks", "reason"),
    [
        ([ask(4), ask(8)], "different sizes"),
        ([ask(4, compute=10), ask(4)], "different sizes"),
        ([ask(4, count=2, linked=True)], "NVLink"),
        ([ask(0)], ""),
    ],
)
def test_claims_a_request_cannot_stand_for_are_not_preempted_for(asks: list[ClaimAsk], reason: str) -> None:
    made = claims_request(asks, MemoryUnit.GIB)
    if reason:
        assert isinstance(made, str) and reason in made
    else:  # 0 bytes asked rounds to 0 units: a request of nothing, which fitting finds no GPU for
        assert isinstance(made, PodRequest)


def test_two_claims_alike_are_one_request_on_two_gpus() -> None:
    made = claims_request([ask(4), ask(4)], MemoryUnit.GIB)
    assert isinstance(made, PodRequest) and made.gpus == 2 and made.per_gpu == 4


# --- the property: the victims free the room, none can be spared, and no smaller set of lower priority does ---


@st.composite
def nodes(draw: st.DrawFn) -> tuple[Ledger, dict[str, set[str]], dict[str, ClaimPod], PodRequest]:
    sizes = draw(st.lists(st.sampled_from([8, 12, 16, 24]), min_size=1, max_size=3))
    holdings: list[Holding] = []
    claims: dict[str, set[str]] = {}
    pods: dict[str, ClaimPod] = {}
    used = [0] * len(sizes)
    for number in range(draw(st.integers(0, 6))):
        gpu = draw(st.integers(0, len(sizes) - 1))
        units = draw(st.integers(1, 8))
        if used[gpu] + units > sizes[gpu]:
            continue
        used[gpu] += units
        claim = f"c{number}"
        holdings.append(device(claim, gpu, units))
        owner = draw(st.sampled_from([f"p{number}", "p-shared"]))
        claims[claim] = {owner}
        pods.setdefault(owner, ClaimPod(draw(st.sampled_from([LOW, MID, HIGH]))))
    wanted = request(draw(st.integers(1, 16)), count=draw(st.integers(1, 2)))
    return Ledger.build(inventory(*sizes), holdings), claims, pods, wanted


def fits_without(ledger: Ledger, claims: Mapping[str, set[str]], gone: set[str], wanted: PodRequest) -> bool:
    freed = {claim for claim, owners in claims.items() if owners and owners <= gone}
    left = [h for h in ledger.holdings() if h.uid.split("/", 1)[0] not in freed]
    return len(fitting(Ledger.build(ledger.inventory, left), wanted)) >= wanted.gpus


@settings(max_examples=300, deadline=None)
@given(nodes())
def test_the_victims_free_the_room_and_none_can_be_spared(
    case: tuple[Ledger, dict[str, set[str]], dict[str, ClaimPod], PodRequest],
) -> None:
    ledger, claims, pods, wanted = case
    found = decide(ledger, claims, pods, wanted, priority=MID + 1)
    lower = {uid for uid, pod in pods.items() if pod.priority < MID + 1}
    # brute force over every set of lower-priority pods
    smallest = next(
        (
            size
            for size in range(len(lower) + 1)
            if any(
                fits_without(ledger, claims, set(gone), wanted) for gone in itertools.combinations(sorted(lower), size)
            )
        ),
        None,
    )
    if found is None:
        assert smallest is None
        return
    assert set(found.pods) <= lower
    assert fits_without(ledger, claims, set(found.pods), wanted)
    for spared in found.pods:  # no victim can be spared
        assert not fits_without(ledger, claims, set(found.pods) - {spared}, wanted)
    assert smallest is not None
    # the lowest highest priority first (as the extender's verb), then the fewest: never more pods than needed
    # at the victims' highest priority
    cheaper = [p for p in lower if pods[p].priority <= (found.highest if found.highest is not None else -1)]
    assert found.highest is None or any(
        fits_without(ledger, claims, set(gone), wanted)
        for size in range(len(found.pods) + 1)
        for gone in itertools.combinations(sorted(cheaper), size)
    )
    assert not any(
        fits_without(ledger, claims, set(gone), wanted)
        for size in range(len(found.pods))
        for gone in itertools.combinations(sorted(cheaper), size)
    )
