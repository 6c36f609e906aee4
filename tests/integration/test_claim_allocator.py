"""The claim allocator against the fake API server (issue #54): claims of gated pods allocated with the
policy, their status written as kube-scheduler writes it and guarded by resourceVersion, gates removed;
hand-overs, waits, the opt-in timeout, and two allocators racing for one claim."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from gpushared.core.placement.claims.gate import CLAIM_GATE
from gpushared.core.placement.policies import BINPACK
from gpushared.core.shared.bodies import uid_of
from gpushared.extender.claims.allocator import AllocatorSettings
from tests.claimworld import (
    ClaimWorld,
    FirstFitScheduler,
    allocation,
    claim,
    consumed_per_device,
    device,
    dra_node,
    gated_pod,
    gates,
    parse,
)
from tests.fakes.apiserver import FakeApiServer, Fault


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        dra_node(server, "n1", 16, 8)
        yield server


def run(api: FakeApiServer, body: Callable[[ClaimWorld], Awaitable[None]], **settings: Any) -> ClaimWorld:
    return ClaimWorld(api, AllocatorSettings(policy=BINPACK, **settings)).run(body)


def test_claims_are_placed_best_fit_where_first_fit_strands_the_second(api: FakeApiServer) -> None:
    """8 GiB then 16 GiB on GPUs of 16 and 8 GiB: first fit takes the 16 GiB GPU for the first claim and
    leaves the second pending; binpack puts the first on the 8 GiB GPU and both run."""

    async def body(world: ClaimWorld) -> None:
        api.create(claim("small", memory="8Gi"))
        api.create(gated_pod("a", "small"))
        await world.until(lambda: not gates(api, "a"))
        api.create(claim("large", memory="16Gi"))
        api.create(gated_pod("b", "large"))
        await world.until(lambda: not gates(api, "b"))

    world = run(api, body)
    assert allocation(api, "small") == [("n1", device(1), "8Gi")]
    assert allocation(api, "large") == [("n1", device(0), "16Gi")]
    stored = api.get("resourceclaims", "small", "default") or {}
    result = stored["status"]["allocation"]["devices"]["results"][0]
    assert result["driver"] == "gpu.gpushared.io" and result["request"] == "gpu"
    assert re.fullmatch(r"[0-9a-f-]{36}", result["shareID"])
    assert result["consumedCapacity"]["compute"] == "0"
    selector = stored["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]
    assert selector == {"key": "metadata.name", "operator": "In", "values": ["n1"]}
    assert world.allocator.counts["allocated"] == 2 and len(world.allocator.latencies) == 2


def test_a_pod_with_a_claim_the_allocator_does_not_place_is_handed_over_saying_why(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        api.create(claim("cel", selectors=[{"cel": {"expression": "true"}}]))
        api.create(gated_pod("a", "cel"))
        await world.until(lambda: not gates(api, "a"))

    world = run(api, body)
    assert allocation(api, "cel") == []  # left to kube-scheduler
    assert world.allocator.counts["handover"] == 1


def test_no_room_keeps_the_pod_gated_fail_closed(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        api.create(claim("huge", memory="32Gi"))
        api.create(gated_pod("a", "huge"))
        for _ in range(20):
            world.allocator.step()
            await world.allocator.settle()
            await asyncio.sleep(0.01)
        assert gates(api, "a") == [CLAIM_GATE]
        assert "no node has room" in world.allocator.told[next(iter(world.allocator.told))]

    run(api, body)
    assert allocation(api, "huge") == []


def test_the_opt_in_timeout_hands_a_pod_over_after_its_time(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        api.create(claim("huge", memory="32Gi"))
        api.create(gated_pod("a", "huge"))
        world.allocator.last_write = float("-inf")
        await world.until(lambda: not gates(api, "a"), within=10)

    world = run(api, body, handover_after=0.3)
    assert world.allocator.counts["timeout"] == 1 and allocation(api, "huge") == []


def test_a_claim_made_from_a_template_is_allocated_once_it_exists(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        pod = api.create(gated_pod("a", template="gpus"))
        for _ in range(5):
            world.allocator.step()
            await asyncio.sleep(0.01)
        assert gates(api, "a") == [CLAIM_GATE]  # its claim does not exist yet: it waits
        made = claim("a-t-x7k2", memory="4Gi")
        made["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": "a", "uid": pod["metadata"]["uid"], "controller": True}
        ]
        api.create(made)
        status = {**pod, "status": {"resourceClaimStatuses": [{"name": "t", "resourceClaimName": "a-t-x7k2"}]}}
        api.rest().request("status", "PUT", "/api/v1/namespaces/default/pods/a/status", body=status)
        await world.until(lambda: not gates(api, "a"))

    run(api, body)
    assert allocation(api, "a-t-x7k2") == [("n1", device(1), "4Gi")]


def test_a_claim_written_meanwhile_is_not_written_again(api: FakeApiServer) -> None:
    """Two allocators (a leader change in the middle of an allocation) decide the same claim from the same
    resourceVersion: the second status write fails with 409, the claim holds the first allocation only,
    and the second allocator forgets what it assumed."""

    async def body(first: ClaimWorld) -> None:
        second = ClaimWorld(api, AllocatorSettings(policy=BINPACK))
        await second.start()
        try:
            api.create(claim("c", memory="8Gi"))
            api.create(gated_pod("a", "c"))
            await first.until(lambda: first.allocator.cache.pending and bool(second.allocator.cache.pending))
            await second.until(lambda: bool(second.claim_cache.claims))
            first.allocator.step()
            second.allocator.step()  # both decided from the same claim before either wrote
            await asyncio.gather(first.allocator.settle(), second.allocator.settle())
            conflicts = first.allocator.counts["conflict"] + second.allocator.counts["conflict"]
            assert conflicts == 1
            assert not first.claim_cache.assumed and not second.claim_cache.assumed
        finally:
            await second.stop()

    run(api, body)
    assert len(allocation(api, "c")) == 1


def test_a_failed_write_is_tried_again(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        api.inject(Fault(method="PUT", path=r"resourceclaims/c/status", status=500))
        api.create(claim("c", memory="8Gi"))
        api.create(gated_pod("a", "c"))
        await world.until(lambda: not gates(api, "a"))

    world = run(api, body)
    assert world.allocator.counts["conflict"] == 1 and allocation(api, "c") == [("n1", device(1), "8Gi")]


def test_a_pod_deleted_before_its_gate_went_has_its_claims_released(api: FakeApiServer) -> None:
    clock = [1000.0]

    async def body(world: ClaimWorld) -> None:
        world.allocator.clock = lambda: clock[0]
        api.create(claim("c", memory="8Gi"))
        api.create(gated_pod("a", "c"))
        api.inject(Fault(method="PATCH", path=r"pods/a$", status=404))  # the pod is gone as the gate is removed
        await world.until(lambda: bool(allocation(api, "c")))
        api.rest().request("delete", "DELETE", "/api/v1/namespaces/default/pods/a")
        clock[0] += 10
        await world.until(lambda: not allocation(api, "c"))

    world = run(api, body)
    assert world.allocator.counts["released"] == 1
    assert (api.get("resourceclaims", "c", "default") or {}).get("status", {}).get("allocation") is None


def test_with_kube_scheduler_allocating_too_no_gpu_goes_past_its_capacity() -> None:
    """The allocator and kube-scheduler's own first fit allocate at once: gated pods by the allocator, pods
    that reached kube-scheduler ungated (the webhook skipped) by kube-scheduler. While kube-scheduler has
    such pods the allocator writes nothing; counted from the claims the API server holds after every round,
    no GPU goes past its memory or compute, and every claim that fits is allocated once."""
    with FakeApiServer() as api:
        dra_node(api, "n1", 16, 8)
        dra_node(api, "n2", 24, 12)
        sizes = ["8Gi", "4Gi", "6Gi", "2Gi", "6Gi", "8Gi", "4Gi", "3Gi", "3Gi", "1Gi", "2Gi", "1Gi"]  # 48 of 60 GiB
        for number, size in enumerate(sizes):
            api.create(claim(f"c{number}", memory=size, compute="20"))
            api.create(gated_pod(f"p{number}", f"c{number}", gated=number % 3 != 0))  # every third ungated
        kube = FirstFitScheduler(api)
        capacities = {
            (s["spec"]["nodeName"], d["name"]): {k: parse(v["value"]) for k, v in d["capacity"].items()}
            for s in api.objects("resourceslices")
            for d in s["spec"]["devices"]
        }

        def within() -> None:
            for key, counted in consumed_per_device(api.objects("resourceclaims")).items():
                for name, amount in counted.items():
                    assert amount <= capacities[key][name], (key, name, amount)

        async def body(world: ClaimWorld) -> None:
            async def scheduling() -> None:
                for _ in range(200):
                    await asyncio.to_thread(kube.round)
                    within()
                    await asyncio.sleep(0.02)

            task = asyncio.ensure_future(scheduling())
            try:
                await world.until(lambda: all(not gates(api, f"p{n}") for n in range(len(sizes))), within=15)
                await world.until(lambda: all(allocation(api, f"c{n}") for n in range(len(sizes))), within=15)
            finally:
                task.cancel()
            within()

        world = run(api, body)
        assert kube.allocated == 4 and world.allocator.counts["allocated"] == 8
        assert world.allocator.counts["not_gated"] == 4


def test_a_status_write_that_lands_although_its_answer_was_cut_is_not_written_twice(api: FakeApiServer) -> None:
    """The API server applies the allocation and the connection is cut before the answer (as after a timeout,
    or a process killed halfway): the allocator forgets its assumption, the watch then shows the claim
    allocated, and the pod's gate is removed with that one allocation."""

    async def body(world: ClaimWorld) -> None:
        api.inject(Fault(method="PUT", path=r"resourceclaims/c/status", cut=True, applied=True))
        api.create(claim("c", memory="8Gi"))
        api.create(gated_pod("a", "c"))
        await world.until(lambda: not gates(api, "a"))

    world = run(api, body)
    assert world.allocator.counts["conflict"] == 1 and world.allocator.counts["allocated"] == 1
    assert allocation(api, "c") == [("n1", device(1), "8Gi")]
    assert not world.claim_cache.assumed


def test_a_pod_kube_scheduler_allocated_before_the_allocator_saw_it_is_counted_not_gated(api: FakeApiServer) -> None:
    """kube-scheduler allocates an ungated pod's claim within moments; the allocator may first see the pod with
    its claim allocated already. It is counted once all the same, and a pod the allocator ungated itself, or
    one waiting when this replica began to lead (its predecessor may have ungated it), never is."""

    async def body(world: ClaimWorld) -> None:
        api.create(claim("before", memory="2Gi"))
        api.create(gated_pod("older", "before", gated=False))
        await asyncio.sleep(0.3)
        world.cache.inbox.drain()
        world.allocator.fence.began_leading(world.cache.claiming.values())
        api.create(claim("fast", memory="4Gi"))
        api.create(gated_pod("skipped", "fast", gated=False))
        FirstFitScheduler(api).round()  # allocated before the allocator's next step
        assert allocation(api, "fast")
        api.create(claim("ours", memory="4Gi"))
        api.create(gated_pod("gated", "ours"))
        await world.until(lambda: not gates(api, "gated"))
        for _ in range(5):
            world.allocator.step()
            await world.allocator.settle()
            await asyncio.sleep(0.05)

    world = run(api, body)
    assert world.allocator.counts["not_gated"] == 1
    assert world.allocator.fence.not_gated == {uid_of(api.get("pods", "skipped", "default") or {})}


def test_the_fence_keeps_room_only_where_kube_schedulers_pods_fit(api: FakeApiServer) -> None:
    """A pod that reached kube-scheduler ungated keeps room back from the allocator only on the GPUs where its
    pending claims fit: one asking for more than any GPU has keeps nothing (a pod waiting for room never
    stops the allocator), and one of 20 GiB that fits only n2's 24 GiB GPU keeps that GPU's room: the next
    pod, of 8 GiB, no longer fits beside it there and goes to n1 at once."""

    async def body(world: ClaimWorld) -> None:
        dra_node(api, "n2", 24)
        api.create(claim("huge", memory="32Gi"))
        api.create(gated_pod("waits", "huge", gated=False))
        api.create(claim("small", memory="4Gi"))
        api.create(gated_pod("a", "small"))
        await world.until(lambda: not gates(api, "a"), within=3)  # not 10 s behind the pod that fits nowhere
        assert world.allocator.counts["fenced"] == 0
        api.create(claim("big", memory="20Gi"))
        api.create(gated_pod("kube", "big", gated=False))  # fits only n2's 24 GiB GPU
        api.create(claim("also", memory="8Gi"))
        api.create(gated_pod("b", "also"))
        await world.until(lambda: not gates(api, "b"), within=3)

    world = run(api, body)
    assert allocation(api, "also")[0][0] == "n1"  # n2's room kept for kube-scheduler: placed where it is not
    assert world.allocator.counts["not_gated"] == 2
