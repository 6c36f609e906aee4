"""Preemption for pods the claim allocator gates, against the fake API server: the pods whose claims hold the
room evicted through the Eviction API, and only they; the room held from lower-priority pods until the
preemptor's claims are allocated there; PodDisruptionBudgets, preemptionPolicy Never and the cap honoured.

kube-controller-manager's claim controller and the kubelet are played by ``ClaimController``: a claim is
deallocated once its last pod is gone only where it carries kube-scheduler's finalizer, as on a real
cluster; kube-scheduler's PreBind and Bind by ``FirstFitScheduler.bind_round``."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest

from gpushared.core.placement.claims.gate import CLAIM_GATE
from gpushared.core.placement.policies import BINPACK
from gpushared.extender.claims import preempting
from gpushared.extender.claims.allocator import AllocatorSettings
from gpushared.extender.evictioncap import EvictionCap
from tests.claimworld import (
    ClaimController,
    ClaimWorld,
    FirstFitScheduler,
    allocation,
    claim,
    device,
    dra_node,
    gated_pod,
    gates,
)
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.fakes.store import RESOURCES
from tests.harness import protect

LOW, HIGH = 0, 100_000
LOWS = [f"low-{i}" for i in range(9)]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    monkeypatch.setattr(preempting, "GRACE_SECONDS", 0.3)
    monkeypatch.setattr(preempting, "RETRY_SECONDS", 0.5)
    with FakeApiServer() as server:
        dra_node(server, "n1", 16, 12, 24, 8)
        yield server


def terminating(api: FakeApiServer) -> list[str]:
    return sorted(p["metadata"]["name"] for p in api.objects("pods") if p["metadata"].get("deletionTimestamp"))


def reasons(api: FakeApiServer, reason: str) -> list[str]:
    return [e["involvedObject"]["name"] for e in api.objects("events") if e.get("reason") == reason]


def gpu_of(api: FakeApiServer, name: str) -> int:
    ((_, dev, _),) = allocation(api, name)
    return next(i for i in range(4) if device(i) == dev)


async def nine_low_pods(world: ClaimWorld, api: FakeApiServer, **labels: str) -> dict[str, int]:
    """Nine 6 GiB claims of priority-0 pods, allocated, reserved and bound: every GPU full to the 6 GiB."""
    scheduler = FirstFitScheduler(api)
    for name in LOWS:
        api.create(claim(f"c-{name}", memory="6Gi"))
        api.create(gated_pod(name, f"c-{name}", priority=LOW, labels=labels or None))
    await world.until(lambda: all(not gates(api, n) for n in LOWS))

    def bound() -> bool:
        scheduler.bind_round()
        return all((api.get("pods", n, "default") or {})["spec"].get("nodeName") for n in LOWS)

    await world.until(bound)
    placed = {name: gpu_of(api, f"c-{name}") for name in LOWS}
    assert sorted(Counter(placed.values()).items()) == [(0, 2), (1, 2), (2, 4), (3, 1)]
    return placed


async def victims_gone_then_allocated(world: ClaimWorld, controller: ClaimController, pod: str) -> None:
    """The victims' kubelet stops them, the claim controller deallocates their claims; until ``pod`` is ungated."""
    controller.stop_terminating()

    def allocated() -> bool:
        controller.round()
        return not gates(world.api, pod)

    await world.until(allocated)


def run(api: FakeApiServer, body: object, **settings: object) -> ClaimWorld:
    return ClaimWorld(api, AllocatorSettings(policy=BINPACK, **settings)).run(body)  # type: ignore[arg-type]


def test_the_pod_on_the_gpu_with_room_goes_and_the_room_is_the_preemptors(api: FakeApiServer) -> None:
    """The issue's case with claims: a 10 GiB claim of a high-priority pod; one 6 GiB pod on the 16 GiB GPU is
    the only single eviction that frees a GPU. A low-priority 4 GiB pod arriving meanwhile is not placed into
    the held room; once the victim's claim is deallocated, the preemptor's claim is allocated there."""
    controller = ClaimController(api)

    async def body(world: ClaimWorld) -> None:
        placed = await nine_low_pods(world, api)
        api.create(claim("c-high", memory="10Gi"))
        api.create(gated_pod("high", "c-high", priority=HIGH))
        await world.until(lambda: bool(terminating(api)))
        (victim,) = terminating(api)
        assert placed[victim] == 0
        api.create(claim("c-late", memory="4Gi"))
        api.create(gated_pod("late", "c-late", priority=LOW))
        for _ in range(10):  # the victim still terminating: nothing frees, nothing is evicted twice
            world.allocator.step()
            await world.allocator.settle()
        assert terminating(api) == [victim]
        await victims_gone_then_allocated(world, controller, "high")
        assert gpu_of(api, "c-high") == 0
        for _ in range(10):
            world.allocator.step()
            await world.allocator.settle()
        assert gates(api, "late") == [CLAIM_GATE]  # GPU 0 is the preemptor's: 16 - 6 - 10 = 0 left
        assert reasons(api, "Preempted") == [victim]
        assert reasons(api, "Preempting") == ["high"]
        alive = {p["metadata"]["name"] for p in api.objects("pods")}
        assert set(LOWS) - alive == {victim}

    world = run(api, body)
    assert world.allocator.preempter.counts["evicted"] == 1
    assert world.allocator.preempter.holds == {}


def test_without_the_finalizer_the_claim_would_never_free(api: FakeApiServer) -> None:
    """The allocator's claims carry kube-scheduler's finalizer: kube-controller-manager clears the allocation
    of a standalone claim whose pods are gone only then."""
    controller = ClaimController(api)

    async def body(world: ClaimWorld) -> None:
        await nine_low_pods(world, api)
        stored = api.get("resourceclaims", "c-low-0", "default") or {}
        assert stored["metadata"]["finalizers"] == ["resource.kubernetes.io/delete-protection"]
        api.store.delete(RESOURCES["pods"], "default", "low-0", {"gracePeriodSeconds": 0})
        controller.round()
        assert allocation(api, "c-low-0") == []

    run(api, body)


def test_a_disruption_budget_that_allows_none_evicts_nothing(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        protect(api, *(await nine_low_pods(world, api)))
        api.create(claim("c-high", memory="10Gi"))
        api.create(gated_pod("high", "c-high", priority=HIGH))
        await world.until(lambda: world.allocator.preempter.counts["refused"] >= 2, within=15)
        assert terminating(api) == [] and world.allocator.preempter.holds == {}
        assert gates(api, "high") == [CLAIM_GATE]

    run(api, body)


def test_a_pod_that_may_not_preempt_and_a_pod_of_equal_priority_evict_nothing(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        await nine_low_pods(world, api)
        polite = gated_pod("polite", "c-polite", priority=HIGH)
        polite["spec"]["preemptionPolicy"] = "Never"  # as the API server copies it from the PriorityClass
        api.create(claim("c-polite", memory="10Gi"))
        api.create(polite)
        api.create(claim("c-peer", memory="10Gi"))
        api.create(gated_pod("peer", "c-peer", priority=LOW))
        for _ in range(40):
            world.allocator.step()
            await world.allocator.settle()
            await asyncio.sleep(0.05)
        assert terminating(api) == []
        assert gates(api, "polite") == [CLAIM_GATE] and gates(api, "peer") == [CLAIM_GATE]
        # no pod holds a claim at a priority below the peer's: it is not even searched for
        assert world.allocator.preempter.counts["no_victims"] == 0

    run(api, body)


def test_the_cap_stops_a_namespace_evicting_without_end(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        await nine_low_pods(world, api)
        world.allocator.preempter.cap = EvictionCap(0)
        api.create(claim("c-high", memory="10Gi"))
        api.create(gated_pod("high", "c-high", priority=HIGH))
        await world.until(lambda: world.allocator.preempter.counts["capped"] >= 1)
        assert terminating(api) == []
        assert "evicted for it this minute" in world.allocator.told[next(iter(world.allocator.told))]

    run(api, body)


def test_an_eviction_cut_after_it_landed_evicts_no_one_more(api: FakeApiServer) -> None:
    """The eviction lands but its answer is cut: the hold stays, and no second pod is evicted while the first
    terminates, past the retry a refused eviction waits."""

    async def body(world: ClaimWorld) -> None:
        await nine_low_pods(world, api)
        api.inject(Fault(method="POST", path=r"/eviction$", cut=True, applied=True))
        api.create(claim("c-high", memory="10Gi"))
        api.create(gated_pod("high", "c-high", priority=HIGH))
        await world.until(lambda: bool(terminating(api)))
        for _ in range(30):  # 1.5 s: three times the retry
            world.allocator.step()
            await world.allocator.settle()
            await asyncio.sleep(0.05)
        assert len(terminating(api)) == 1
        assert world.allocator.preempter.counts["failed"] == 1 and world.allocator.preempter.counts["evicted"] == 0
        assert list(world.allocator.preempter.holds) == [api.get("pods", "high", "default")["metadata"]["uid"]]  # type: ignore[index]

    run(api, body)


def test_a_new_leader_waits_for_the_victims_an_old_one_evicted(api: FakeApiServer) -> None:
    """A leader evicts and is gone (its holds with it); the next one finds the victim terminating, holds the
    room it frees and evicts no one more; the preemptor gets the GPU once the victim's claim is gone."""
    controller = ClaimController(api)

    async def body(world: ClaimWorld) -> None:
        await nine_low_pods(world, api)
        api.create(claim("c-high", memory="10Gi"))
        api.create(gated_pod("high", "c-high", priority=HIGH))
        await world.until(lambda: bool(terminating(api)))
        (victim,) = terminating(api)
        await world.stop()
        await world.start()  # a fresh allocator, caches and holds: a takeover
        await world.until(lambda: world.allocator.preempter.counts["coming"] >= 1)
        assert terminating(api) == [victim] and world.allocator.preempter.counts["evicted"] == 0
        await victims_gone_then_allocated(world, controller, "high")
        assert gpu_of(api, "c-high") == 0
        assert set(LOWS) - {p["metadata"]["name"] for p in api.objects("pods")} == {victim}

    run(api, body)


def test_victims_break_the_fewest_disruption_budgets(api: FakeApiServer) -> None:
    """The two pods on the 16 GiB GPU are protected by a budget that allows no disruption: two unprotected pods
    on a full GPU go instead (the lowest priority, then the fewest budgets broken, then the fewest pods)."""
    controller = ClaimController(api)

    async def body(world: ClaimWorld) -> None:
        placed = await nine_low_pods(world, api)
        protect(api, *(n for n, gpu in placed.items() if gpu == 0))
        await world.until(lambda: bool(world.cache.budgets.budgets))
        api.create(claim("c-high", memory="10Gi"))
        api.create(gated_pod("high", "c-high", priority=HIGH))
        await world.until(lambda: len(terminating(api)) == 2)
        assert {placed[name] for name in terminating(api)} in ({1}, {2})
        await victims_gone_then_allocated(world, controller, "high")
        assert gpu_of(api, "c-high") in (1, 2)
        assert world.allocator.preempter.counts["refused"] == 0

    run(api, body)
