"""The claim allocator's fence against the fake API server: it keeps free the room kube-scheduler's pods could
take, never whole nodes, so a tenant whose pods kube-scheduler never places holds no one else back; and
pods waiting for room are not priced again until something they read changes, so two thousand of them
neither slow a step nor keep an ordinary pod waiting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpushared.core.placement.policies import BINPACK
from gpushared.extender.claims.allocator import AllocatorSettings
from gpushared.extender.claims.fence import KUBE_WINDOW_SECONDS
from tests.claimtenant import SimulatedTime, TenantCase
from tests.claimworld import ClaimWorld, allocation, claim, dra_node, gated_pod, gates
from tests.fakes.apiserver import FakeApiServer


def run(api: FakeApiServer, body: Callable[[ClaimWorld], Awaitable[None]], **world: Any) -> ClaimWorld:
    return ClaimWorld(api, AllocatorSettings(policy=BINPACK), **world).run(body)


@pytest.mark.parametrize(("reason", "kept"), [("selector", False), ("affinity", True)])
def test_a_tenants_pods_kube_scheduler_never_places_hold_no_other_pod_back(reason: str, kept: bool) -> None:
    """One tenant creates, every 2 s, a pod without the gate whose 1 GiB claim fits every GPU and which
    kube-scheduler can never place: it stays kube-scheduler's. Holding every node where such a pod fits (as the
    fence once did) held another tenant's gated 4 GiB pod back for as long as the tenant kept on. A node
    selector no node matches, the fence now reads: it keeps such a pod's room nowhere. A required pod
    affinity no pod satisfies, it does not model: it keeps 1 GiB per such pod on each GPU, and the 4 GiB pod
    is allocated at once beside them all the same."""
    with FakeApiServer() as api:
        dra_node(api, "n1", 16, 16)
        dra_node(api, "n2", 16, 16)
        time_ = SimulatedTime()
        case: TenantCase | None = None

        async def body(world: ClaimWorld) -> None:
            nonlocal case
            case = TenantCase(api, world, clock=time_, tick=time_.tick, lead=12.0, ordinary=3, reasons=(reason,))
            case.shown_first = True
            await case.run()

        world = run(api, body, clock=time_)
        assert case is not None
        assert max(case.waits) <= 2.0, case.waits
        assert world.allocator.counts["fenced"] == 0
        assert case.tenant_pods >= 9
        assert all(allocation(api, f"ordinary-{n}") for n in range(3))
        if kept:  # the fence kept the tenant's room all along: five pods in its window, 1 GiB each on every GPU
            assert case.most_kept >= KUBE_WINDOW_SECONDS / 2.0 - 1, case.most_kept
        else:
            assert case.most_kept == 0


def test_a_gated_pod_that_fits_only_in_the_room_kept_waits_at_most_one_window() -> None:
    """kube-scheduler's pods that fit every GPU, enough of them to fill each GPU's free room: a gated pod fits
    only in the room kept, so it waits (fenced, counted), but never longer than one window in a row: then
    it is placed as a pod past its window is, the driver's check at prepare behind it. A flood of pods
    kube-scheduler never places cannot stop the allocator for good."""
    with FakeApiServer() as api:
        dra_node(api, "n1", 16)
        time_ = SimulatedTime(step=0.5)
        case: TenantCase | None = None

        async def body(world: ClaimWorld) -> None:
            nonlocal case
            case = TenantCase(
                api, world, clock=time_, tick=time_.tick, every=0.5, tenant_memory="4Gi", lead=3.0, give_up=30.0
            )
            case.reasons, case.shown_first = ("affinity",), True
            await case.run()

        world = run(api, body, clock=time_)
        assert case is not None
        assert case.most_kept == 16  # the whole GPU kept
        assert KUBE_WINDOW_SECONDS <= case.waits[0] <= KUBE_WINDOW_SECONDS + 3, case.waits
        assert world.allocator.counts["fenced"] > 0


def test_two_thousand_pods_waiting_for_room_are_priced_again_only_when_something_changed() -> None:
    """2,000 gated pods whose claims fit no GPU: they are priced once (one kind), not at every step; a full
    turn through them costs a lookup each. An ordinary pod created behind them is allocated within two turns,
    and its allocation (a ledger changed) has their kind priced once more."""
    with FakeApiServer() as api:
        dra_node(api, "n1", 16, 16)
        dra_node(api, "n2", 16, 16)
        for number in range(2000):
            api.create(claim(f"u{number}", memory="32Gi"))
            api.create(gated_pod(f"u{number}", f"u{number}"))

        async def body(world: ClaimWorld) -> None:
            allocator = world.allocator
            decided = [0]
            decide = allocator.decide

            def counted(pod: Any, now: float) -> Any:
                decided[0] += 1
                return decide(pod, now)

            allocator.decide = counted  # type: ignore[method-assign]
            deadline = time.monotonic() + 60
            while len(allocator.cache.claiming) < 2000 or len(world.claim_cache.claims.get("default", {})) < 2000:
                assert time.monotonic() < deadline
                allocator.cache.inbox.drain()
                world.claim_cache.drain()
                await asyncio.sleep(0.05)

            async def turn() -> None:
                """Steps until 2,000 more pods were decided (a turn through them all)."""
                until = decided[0] + 2000
                while decided[0] < until:
                    allocator.step()
                    await allocator.settle()

            await turn()
            first = allocator.placer.pricings
            assert 1 <= first <= 2  # their one kind, once (twice if something changed between steps)
            for _ in range(3):
                await turn()
            assert allocator.placer.pricings == first
            assert all(reason.startswith("no node has room") for reason in allocator.told.values())
            api.create(claim("ordinary", memory="4Gi"))
            api.create(gated_pod("ordinary", "ordinary"))
            seen: int | None = None  # decisions made when the allocator first saw it (the watch's delay aside)
            deadline = time.monotonic() + 60
            while gates(api, "ordinary"):
                assert time.monotonic() < deadline
                if seen is None and ("default", "ordinary") in allocator.cache.claiming:
                    seen = decided[0]
                assert seen is None or decided[0] - seen <= 2 * 2001, "not allocated within two turns"
                allocator.step()
                await allocator.settle()
                await asyncio.sleep(0.005)
            # the ordinary pod's kind once, theirs once more after its allocation changed a ledger
            assert allocator.placer.pricings - first <= 3

        run(api, body)
        assert allocation(api, "ordinary")
