"""Where the claim allocator puts a pod's claims (``core.placement.claims.choice``): each row a cluster, the
claims, and the node and GPUs the policy gives them, worked out by hand; then properties over any sequence
of claims: never past a GPU's memory or compute as kube-scheduler's own arithmetic counts them, and a claim
shaped like a gpu-mem pod placed where the extender places that pod."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.contract import MemoryUnit, dra
from gpushared.core.dra import capacity
from gpushared.core.dra.allocated import allocated_devices
from gpushared.core.dra.allocation import GivenDevice, allocation_body
from gpushared.core.dra.slices import gpu_device
from gpushared.core.placement.claims.asks import ClaimAsk, DeviceAsk
from gpushared.core.placement.claims.choice import (
    CandidateNode,
    ClaimChoice,
    NoRoom,
    Setting,
    choose,
    holdings_of,
    may_fit,
    parts,
    place_on,
)
from gpushared.core.placement.policies import BINPACK, FGD, SPREAD, Policy
from gpushared.core.placement.pricing import PricingContext
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from tests.builders import inventory

GI = 2**30


def claim(
    *sizes: int | None, count: int = 1, compute: int = 0, mps: bool = False, linked: bool = False, uid: str = "c"
) -> ClaimAsk:
    """A claim of one request per size (GiB; None: whole GPUs), ``count`` devices each."""
    requests = tuple(
        DeviceAsk(request=f"r{n}", count=count, memory=None if size is None else size * GI, compute=compute)
        for n, size in enumerate(sizes)
    )
    return ClaimAsk(
        namespace="team", name=uid, uid=uid, resource_version="1", requests=requests, linked=linked, mps=mps
    )


def node(name: str, *sizes: int, mps: bool = False, domains: dict[int, str] | None = None) -> CandidateNode:
    ledger = Ledger.build(inventory(*sizes, mps=mps))
    devices = {gpu.index: f"gpu-{gpu.index}" for gpu in ledger.inventory.gpus}
    return CandidateNode(name=name, ledger=ledger, devices=devices, domains=domains or {})


def held(candidate: CandidateNode, index: int, amount: int, *, compute: int = 0, mps: bool = False) -> CandidateNode:
    candidate.ledger.add(
        Holding(
            uid=f"h{index}-{amount}",
            namespace="d",
            name="x",
            gpus={index: amount},
            mps=mps,
            assigned=True,
            compute=compute,
        )
    )
    return candidate


def where(result: ClaimChoice | NoRoom) -> tuple[str, list[tuple[int, str, int]]] | str:
    if isinstance(result, NoRoom):
        return result.reason
    return result.node, [(p.claim, p.request, p.index) for p in result.picks]


def allocate_in_turn(
    asks: Sequence[ClaimAsk], candidates: Sequence[CandidateNode], policy: Policy
) -> list[tuple[str, list[tuple[int, str, int]]] | str]:
    """Each claim in turn, as the allocator takes pods one after another, its holdings counted."""
    by_name = {c.name: c for c in candidates}
    found: list[tuple[str, list[tuple[int, str, int]]] | str] = []
    for ask in asks:
        result = choose([ask], candidates, policy)
        found.append(where(result))
        if isinstance(result, ClaimChoice):
            for holding in holdings_of(result, [ask]):
                by_name[result.node].ledger.add(holding)
    return found


def test_best_fit_places_what_first_fit_strands() -> None:
    # First fit puts the 8 GiB claim on GPU 0 (16 GiB) and leaves no GPU for the 16 GiB one; binpack puts it
    # on GPU 1, where it fits exactly, and the 16 GiB claim gets GPU 0.
    n = node("n1", 16, 8)
    assert allocate_in_turn([claim(8, uid="a"), claim(16, uid="b")], [n], BINPACK) == [
        ("n1", [(0, "r0", 1)]),
        ("n1", [(0, "r0", 0)]),
    ]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (BINPACK, "full"),  # the fuller node, kept for the small claim
        (SPREAD, "empty"),
    ],
)
def test_the_node_is_the_policys(policy: Policy, expected: str) -> None:
    full = held(node("full", 16), 0, 8)
    empty = node("empty", 16)
    result = choose([claim(4)], [empty, full], policy)
    assert isinstance(result, ClaimChoice) and result.node == expected


def test_ties_go_to_kube_schedulers_preference_then_the_name() -> None:
    a, b = node("a", 16), node("b", 16)
    assert where(choose([claim(4)], [b, a], BINPACK)) == ("a", [(0, "r0", 0)])
    preferred = CandidateNode(name="b", ledger=b.ledger, devices=b.devices, kube_score=5.0)
    assert where(choose([claim(4)], [a, preferred], BINPACK)) == ("b", [(0, "r0", 0)])


@pytest.mark.parametrize(
    ("asks", "used", "expected"),
    [
        # whole GPUs: only an empty one, never one with anything on it
        ([claim(None)], {0: 1}, ("n", [(0, "r0", 1)])),
        ([claim(None, count=2)], {0: 1}, "no node has room for the 2 device(s) the pod's claims ask for"),
        # two requests of one claim: two GPUs, never the same one twice
        ([claim(8, 8)], {}, ("n", [(0, "r0", 0), (0, "r1", 1)])),
        # two shapes: the larger first, on the GPU it fits best; the smaller on what is left
        ([claim(4, 12)], {}, ("n", [(0, "r1", 1), (0, "r0", 0)])),
        # two claims of one pod, one shape: one request over both, one GPU each
        ([claim(8, uid="x"), claim(8, uid="y")], {}, ("n", [(0, "r0", 0), (1, "r0", 1)])),
        # 1.5 GiB rounds up to 2 units: GPU 0 has 1 left, GPU 1 has 4
        (
            [ClaimAsk("t", "c", "c", "1", (DeviceAsk("r0", 1, 3 * GI // 2, 0),), linked=False, mps=False)],
            {0: 7, 1: 8},
            ("n", [(0, "r0", 1)]),
        ),
    ],
)
def test_what_each_request_gets(asks: list[ClaimAsk], used: dict[int, int], expected: object) -> None:
    n = node("n", 8, 12)
    for index, amount in used.items():
        held(n, index, amount)
    assert where(choose(asks, [n], BINPACK)) == expected


def test_compute_is_the_second_dimension() -> None:
    n = held(node("n", 16, 16), 0, 2, compute=50)  # GPU 0: best fit for memory, but half its compute taken
    assert where(choose([claim(4, compute=60)], [n], BINPACK)) == ("n", [(0, "r0", 1)])
    assert where(choose([claim(4, compute=40)], [n], BINPACK)) == ("n", [(0, "r0", 0)])


def test_mps_and_plain_claims_never_share_a_gpu() -> None:
    n = held(node("n", 16, 16, mps=True), 0, 4)  # GPU 0 serves a plain claim
    assert where(choose([claim(4, mps=True)], [n], BINPACK)) == ("n", [(0, "r0", 1)])
    held(n, 1, 4, mps=True)
    assert where(choose([claim(4)], [n], BINPACK)) == ("n", [(0, "r0", 0)])


def test_only_the_slices_devices_are_given() -> None:
    n = node("n", 16, 8)
    unpublished = CandidateNode(name="n", ledger=n.ledger, devices={0: "gpu-0"})  # GPU 1 left the slice (unhealthy)
    assert where(choose([claim(8)], [unpublished], BINPACK)) == ("n", [(0, "r0", 0)])
    assert isinstance(choose([claim(8, 8)], [unpublished], BINPACK), NoRoom)


def test_nvlink_keeps_the_devices_in_one_domain() -> None:
    domains = {0: "a", 1: "a", 2: "b", 3: "b"}
    n = held(node("n", 16, 16, 16, 16, domains=domains), 1, 12)  # domain a has one GPU with 16 GiB free
    assert where(choose([claim(8, count=2, linked=True)], [n], BINPACK)) == ("n", [(0, "r0", 2), (0, "r0", 3)])
    assert where(choose([claim(8, count=3, linked=True)], [n], BINPACK)).startswith("no node")  # type: ignore[union-attr]
    # unlinked, binpack takes the fullest GPU with room first, across domains
    assert where(choose([claim(4, count=2)], [n], BINPACK)) == ("n", [(0, "r0", 1), (0, "r0", 0)])


def test_no_candidates_and_no_asks_say_why() -> None:
    assert where(choose([], [node("n", 16)], BINPACK)) == "the pod has no pending claim of this driver"
    assert "no node publishes" in str(where(choose([claim(4)], [], BINPACK)))


def test_parts_come_largest_first_whole_gpus_before_all() -> None:
    found = parts([claim(4, None, 12)], MemoryUnit.GIB)
    assert [(p.request, p.units) for p in found] == [("r1", None), ("r2", 12), ("r0", 4)]


# --- properties ---------------------------------------------------------------------------------------------

SIZES = st.sampled_from([None, 1, 2, 3, 4, 6, 8, 12, 16])


@st.composite
def claims(draw: st.DrawFn) -> list[ClaimAsk]:
    found = []
    for number in range(draw(st.integers(1, 30))):
        sizes = draw(st.lists(SIZES, min_size=1, max_size=2))
        found.append(
            claim(
                *sizes,
                count=draw(st.integers(1, 2)),
                compute=draw(st.sampled_from([0, 0, 10, 30, 60])),
                mps=draw(st.booleans()),
                uid=f"c{number}",
            )
        )
    return found


@settings(max_examples=60, deadline=None)
@given(asks=claims(), policy=st.sampled_from([BINPACK, FGD, SPREAD]))
def test_never_past_a_gpu_as_kube_scheduler_counts_it(asks: list[ClaimAsk], policy: Policy) -> None:
    """Every allocation written as the allocator writes it, read back as the driver reads it, and counted
    with kube-scheduler's consumable-capacity arithmetic against the slice's devices: no GPU past its memory
    or compute, what each consumes is what kube-scheduler would compute for the claim's request, and an
    MPS claim never shares a GPU with a plain one."""
    inv = inventory(16, 12, 24, 8, mps=True)
    candidates = [node("n", 16, 12, 24, 8, mps=True)]
    models = {gpu.index: capacity.model_device(gpu_device(gpu, inv, domain=None)) for gpu in inv.gpus}
    used: dict[int, dict[str, int]] = {index: {} for index in models}
    modes: dict[int, set[bool]] = {index: set() for index in models}
    for ask in asks:
        result = choose([ask], candidates, policy)
        if isinstance(result, NoRoom):
            continue
        body = allocation_body(
            node="n",
            devices=[
                GivenDevice(p.request, dra.device_name(inv.gpus[p.index].uuid), p.units * GI, p.compute, f"s-{n}")
                for n, p in enumerate(result.picks)
            ],
            allocated_at="2026-01-02T03:04:05Z",
        )
        read = allocated_devices({"status": {"allocation": body}})
        assert len({d.device for d in read}) == len(read) == ask.devices
        for given_device, pick in zip(read, result.picks, strict=True):
            asked = next(r for r in ask.requests if r.request == pick.request)
            wanted = {dra.CAPACITY_COMPUTE: asked.compute}
            if asked.memory is not None:
                wanted[dra.CAPACITY_MEMORY] = asked.memory
            counted = capacity.fits(models[pick.index], used[pick.index], wanted)
            assert counted is not None, (pick, used[pick.index])
            assert counted[dra.CAPACITY_MEMORY] == given_device.memory
            assert counted[dra.CAPACITY_COMPUTE] == given_device.compute
            for name, amount in counted.items():
                used[pick.index][name] = used[pick.index].get(name, 0) + amount
            modes[pick.index].add(ask.mps)
            assert len(modes[pick.index]) == 1
        for holding in holdings_of(result, [ask]):
            candidates[0].ledger.add(holding)


@settings(max_examples=60, deadline=None)
@given(
    used=st.lists(st.integers(0, 16), min_size=4, max_size=4),
    size=st.integers(1, 16),
    count=st.integers(1, 3),
    policy=st.sampled_from([BINPACK, FGD, SPREAD]),
)
def test_a_claim_shaped_like_a_pod_goes_where_the_extender_puts_the_pod(
    used: list[int], size: int, count: int, policy: Policy
) -> None:
    n = node("n", 16, 16, 16, 16)
    for index, amount in enumerate(used):
        if amount:
            held(n, index, amount)
    request = PodRequest(containers=(ContainerRequest("c", size * count, gpus=count),))
    extender = policy.appraise(n.ledger, request, PricingContext(n.ledger))
    result = choose([claim(size, count=count)], [CandidateNode("n", n.ledger, n.devices, setting=Setting())], policy)
    if extender is None:
        assert isinstance(result, NoRoom)
    else:
        assert isinstance(result, ClaimChoice)
        assert result.rank == extender[0]
        assert [p.index for p in result.picks] == [v.gpu.index for v in extender[1]]


@settings(max_examples=80, deadline=None)
@given(asks=claims(), probe=claims(), policy=st.sampled_from([BINPACK, FGD, SPREAD]))
def test_may_fit_is_never_false_where_a_placement_exists(
    asks: list[ClaimAsk], probe: list[ClaimAsk], policy: Policy
) -> None:
    """The fence's cheap test: on a node filled by any claims placed in turn, wherever ``place_on`` places a
    claim, ``may_fit`` says it may fit (it may say so where no placement exists: holding a node too many
    costs a wait, one too few could put a GPU past its capacity)."""
    candidate = node("n", 16, 12, 24, 8, mps=True)
    for ask in asks:
        result = choose([ask], [candidate], policy)
        if isinstance(result, ClaimChoice):
            for holding in holdings_of(result, [ask]):
                candidate.ledger.add(holding)
    for ask in probe[:5]:
        if place_on([ask], candidate, policy) is not None:
            assert may_fit([ask], candidate.ledger, candidate.devices)


def test_may_fit_is_generous_but_not_blind() -> None:
    candidate = held(node("n", 16, 8), 0, 16)  # the 16 GiB GPU full, the 8 GiB one empty
    assert may_fit([claim(8)], candidate.ledger, candidate.devices)
    assert not may_fit([claim(12)], candidate.ledger, candidate.devices)
    assert not may_fit([claim(4, count=2)], candidate.ledger, candidate.devices)
    assert may_fit([claim(None)], candidate.ledger, candidate.devices)  # the empty GPU, whole
    assert not may_fit([claim(8)], candidate.ledger, {0: "gpu-0"})  # only the full GPU published
