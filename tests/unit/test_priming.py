"""The primer: a pending pod's request priced on every node before kube-scheduler asks, once per slot, a few
nodes per turn of the event loop, and never a different answer than the verb would have worked out."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Any, cast

import pytest

from gpushared import contract
from gpushared.core.placement.policies import BINPACK, Policy
from gpushared.core.shared.bodies import awaits_node
from gpushared.core.shared.requests import pod_request
from gpushared.extender.cache import ClusterCache
from gpushared.extender.priming import BURST_SECONDS, SHARE, STALE_SECONDS, Primer, pacing
from gpushared.extender.scheduler import Scheduler
from gpushared.kube.aioapi import AsyncApi
from tests.builders import inventory, pod
from tests.extender_harness import gpu_node

NODES = tuple(f"n{i}" for i in range(5))


def terminating(body: dict[str, Any]) -> dict[str, Any]:
    body["metadata"]["deletionTimestamp"] = "2026-11-25T00:00:00Z"
    return body


@pytest.mark.parametrize(
    ("body", "waits"),
    [
        (pod("new", 4), True),
        (pod("no-status", 4) | {"status": {}}, True),
        (pod("no-gpu"), True),  # waits for a node; not the primer's to price (Primer.prime)
        (pod("bound", 4, node="n1"), False),
        (pod("bound-pending", 4, node="n1", phase="Pending"), False),
        (terminating(pod("deleted", 4)), False),
        (pod("failed", 4, phase="Failed"), False),
        (pod("succeeded", 4, phase="Succeeded"), False),
    ],
    ids=lambda v: v["metadata"]["name"] if isinstance(v, dict) else str(v),
)
def test_which_pods_wait_for_a_node(body: dict[str, Any], waits: bool) -> None:
    assert awaits_node(body) is waits


def counting_cache(cost: Callable[[], None] = lambda: None) -> tuple[ClusterCache, Scheduler, list[str]]:
    """Five nodes, one pod running; a binpack that records the node of every GPU it prices (and calls
    ``cost`` each time, for a test's clock)."""
    cache = ClusterCache(list_nodes=lambda **_: None, list_pods=lambda **_: None, resources=contract.DEFAULT_RESOURCES)
    inv = inventory(16, 16)
    for name in NODES:
        cache.on_node(None, gpu_node(name, inv=inv, cpu="8"))
    cache.on_pod(None, pod("running", 5, node="n1", phase="Running"))
    priced: list[str] = []
    ledgers = {id(cache.state.nodes[name].ledger): name for name in NODES}

    def price(*args: Any) -> float:
        priced.append(ledgers[id(args[2].ledger)])
        cost()
        return BINPACK.price(*args)

    policy: Policy = dataclasses.replace(BINPACK, price=price)
    scheduler = Scheduler(
        cache=cache, api=cast(AsyncApi, None), policy=policy, resources=contract.DEFAULT_RESOURCES, rank_in_filter=False
    )
    return cache, scheduler, priced


def test_the_pod_informer_offers_the_pods_that_wait_for_a_node() -> None:
    cache, _, _ = counting_cache()
    offered: list[str] = []
    cache.pending_seen = lambda body: offered.append(body["metadata"]["name"])
    for body in (pod("waits", 3), pod("bound", 3, node="n2", phase="Running"), terminating(pod("going", 3))):
        cache.on_pod(None, body)
    assert offered == ["waits"]


def test_a_slot_is_priced_on_every_node_once_and_the_verb_then_prices_none() -> None:
    cache, scheduler, priced = counting_cache()
    primer = Primer(
        scheduler.cache, policy=scheduler.policy, resources=scheduler.resources, ready=lambda: True, chunk=2
    )
    first = pod("first", 3)
    assert asyncio.run(primer.prime(first))
    assert sorted(priced) == sorted(NODES)
    priced.clear()
    # Another pod of the same slot is not priced again, and its verb finds every rank kept.
    assert not asyncio.run(primer.prime(pod("second", 3)))
    ranks = cache.index.node_ranks(list(NODES), pod("second", 3), pod_request(pod("second", 3)), scheduler.policy)
    assert not priced
    # The same ranks a cold verb works out.
    cold, cold_scheduler, _ = counting_cache()
    assert ranks == cold.index.node_ranks(list(NODES), pod("x", 3), pod_request(pod("x", 3)), cold_scheduler.policy)
    # A bind changes one node: only it is priced again, by the verb (a slot is primed once).
    cache.on_pod(None, pod("landed", 2, node="n3", phase="Running"))
    assert not asyncio.run(primer.prime(pod("third", 3)))
    cache.index.node_ranks(list(NODES), first, pod_request(first), scheduler.policy)
    assert priced == ["n3"]
    # A new size is a new slot; a pod asking for no GPU memory, or a malformed one, is not primed.
    priced.clear()
    assert asyncio.run(primer.prime(pod("bigger", 7)))
    assert sorted(priced) == sorted(NODES)
    malformed = pod("malformed", 3)
    malformed["spec"]["containers"][0]["resources"]["limits"][contract.DEFAULT_RESOURCES.gpu_mem] = "lots"
    assert not asyncio.run(primer.prime(pod("no-gpu")))
    assert not asyncio.run(primer.prime(malformed))
    assert primer.slots_primed == 2


def test_priming_yields_to_the_loop_between_chunks() -> None:
    """A verb that arrives while a slot is primed waits for one chunk, not for every node."""
    _, scheduler, priced = counting_cache()
    primer = Primer(
        scheduler.cache, policy=scheduler.policy, resources=scheduler.resources, ready=lambda: True, chunk=1
    )
    seen_by_verb: list[int] = []

    async def both() -> None:
        priming = asyncio.create_task(primer.prime(pod("p", 3)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        seen_by_verb.append(len(priced))
        await priming

    asyncio.run(both())
    assert 0 < seen_by_verb[0] < len(NODES)
    assert len(priced) == len(NODES)


def test_pending_pods_the_cache_applies_are_primed_once_it_is_ready_one_slot_once() -> None:
    """The cache hands the primer each pod the watch shows pending, as it applies the event on its owner's
    thread; nothing is priced before the cache is ready, and fifty pods of one size are one slot."""
    cache, scheduler, priced = counting_cache()
    ready = False
    fake = FakeTime()
    primer = Primer(
        cache,
        policy=scheduler.policy,
        resources=scheduler.resources,
        ready=lambda: ready,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    cache.pending_seen = primer.offer
    cache.on_pod(None, pod("before-ready", 3))

    async def scenario() -> None:
        nonlocal ready
        running = asyncio.create_task(primer.run())
        for _ in range(10):  # the primer polls whether the cache is ready: 0.05 s of the fake clock a turn
            await asyncio.sleep(0)
        assert primer.slots_primed == 0  # a half-listed cache is not primed
        ready = True
        await until(lambda: primer.slots_primed == 1)
        for i in range(50):
            cache.on_pod(None, pod(f"same-size-{i}", 6))
        await until(lambda: primer.slots_primed == 2 and not primer.waiting())
        assert primer.slots_primed == 2  # fifty pods, one slot
        running.cancel()

    asyncio.run(scenario())
    assert len(priced) == 2 * len(NODES)


async def until(condition: Any, turns: int = 100_000) -> None:
    """Wait for ``condition`` over turns of the event loop, never on the wall clock (the primer's own
    pauses are a fake clock's)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not within {turns} turns of the loop")


@pytest.mark.parametrize(
    ("owed", "elapsed", "after", "pause"),
    [
        (0.0, 0.0, 0.0, 0.0),  # nothing spent
        (BURST_SECONDS, 0.0, BURST_SECONDS, 0.0),  # a burst is free
        (BURST_SECONDS + SHARE, 0.0, BURST_SECONDS + SHARE, 1.0),  # past it: paid back at SHARE a second
        (BURST_SECONDS + SHARE, 1.0, BURST_SECONDS, 0.0),  # ... and a second later it is
        (0.01, 10.0, 0.0, 0.0),  # never owed less than nothing
    ],
)
def test_pacing_keeps_the_primer_within_its_share(owed: float, elapsed: float, after: float, pause: float) -> None:
    assert pacing(owed, elapsed) == pytest.approx((after, pause))


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.priced = 0.0  # seconds the primer spent pricing

    def clock(self) -> float:
        return self.now

    def cost(self) -> None:
        self.now += 0.01
        self.priced += 0.01

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)  # a turn of the loop, none of the wall clock


def test_a_flood_of_distinct_sizes_gets_at_most_its_share_of_the_loop() -> None:
    """Pending pods of sixteen sizes, each priced on five nodes at 10 ms a node: the primer pauses so that
    its pricing stays within the burst plus its share of the time that passed."""
    fake = FakeTime()
    _, scheduler, _ = counting_cache(cost=fake.cost)
    primer = Primer(
        scheduler.cache,
        policy=scheduler.policy,
        resources=scheduler.resources,
        ready=lambda: True,
        chunk=1,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    started = fake.now

    async def flood() -> None:
        for size in range(1, 17):
            assert await primer.prime(pod(f"size-{size}", size))

    asyncio.run(flood())
    assert primer.slots_primed == 16 and fake.priced > 0.5
    assert primer.paused_seconds > 0
    assert fake.priced <= BURST_SECONDS + SHARE * (fake.now - started) + 0.01 + 1e-9


def test_a_pod_offered_long_ago_is_passed_over() -> None:
    fake = FakeTime()
    _, scheduler, _ = counting_cache()
    ready = threading.Event()
    primer = Primer(
        scheduler.cache,
        policy=scheduler.policy,
        resources=scheduler.resources,
        ready=ready.is_set,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    primer.offer(pod("old", 3))
    fake.now += STALE_SECONDS + 1  # its cycle has passed while the cache synced
    primer.offer(pod("fresh", 5))

    async def scenario() -> None:
        running = asyncio.create_task(primer.run())
        ready.set()
        await until(lambda: primer.slots_primed == 1 and not primer.waiting())
        running.cancel()

    asyncio.run(scenario())
    assert primer.slots_primed == 1
