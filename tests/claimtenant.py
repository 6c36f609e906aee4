"""A tenant whose pods kube-scheduler never places, against another tenant's ordinary pod: the claim
allocator's fence must not let the one hold the other back.

The tenant creates, every ``every`` seconds, a pod without the allocator's gate (the webhook skipped it, or
it was made before) with a small claim of gpushared's class that kube-scheduler can never place: its claim
fits every GPU, and it stays kube-scheduler's. Why it cannot be placed, pod after pod in turn (``reasons``):
``"selector"``, a node selector no node matches (the allocator reads node selection, so the fence counts
such a pod on no node); ``"affinity"``, a required pod affinity to pods that do not exist (which the fence
does not model: it keeps the pod's room on every GPU). After ``lead`` seconds of that, another tenant's
ordinary gated pods are created one at a time; each one's time from its creation to its gate removed (its
claims allocated) is what the case measures.

Driven by a clock and a tick, so that a test runs it on simulated time (``SimulatedTime``) and the fault
suite (``scripts/faultsuite/tenant.py``) on the wall clock. Shared by ``tests/integration/test_claim_fence.py``
and the fault suite.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tests.claimworld import ClaimWorld, claim, gated_pod, gates
from tests.fakes.apiserver import FakeApiServer

#: The node selector of the tenant's pods: no node has this label.
NOWHERE = {"gpushared.io/test-pool": "nowhere"}
#: A required pod affinity no pod satisfies: pods labelled so do not exist (nor is the tenant's pod one).
WITH_NO_ONE = {
    "podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "labelSelector": {"matchLabels": {"gpushared.io/test-app": "no-one"}},
                "topologyKey": "kubernetes.io/hostname",
            }
        ]
    }
}


def unschedulable_pod(name: str, claim_name: str, *, reason: str = "selector") -> dict[str, Any]:
    """A pod kube-scheduler never places, without the allocator's gate: no node matches its selector
    (``reason`` "selector"), or no pod its required pod affinity ("affinity")."""
    body = gated_pod(name, claim_name, gated=False)
    if reason == "selector":
        body["spec"]["nodeSelector"] = dict(NOWHERE)
    else:
        body["spec"]["affinity"] = WITH_NO_ONE
    return body


class SimulatedTime:
    """The allocator's clock, moved on by ``step`` seconds each tick (with a short real pause, so that the
    watches bring what the tick's writes changed)."""

    def __init__(self, step: float = 0.1, pause: float = 0.02) -> None:
        self.now, self.step, self.pause = 1000.0, step, pause

    def __call__(self) -> float:
        return self.now

    async def tick(self) -> None:
        self.now += self.step
        await asyncio.sleep(self.pause)


@dataclass
class TenantCase:
    api: FakeApiServer
    world: ClaimWorld
    clock: Callable[[], float]
    tick: Callable[[], Awaitable[None]]
    #: seconds between the tenant's pods, and what each one's claim asks
    every: float = 2.0
    tenant_memory: str = "1Gi"
    #: why kube-scheduler cannot place the tenant's pods, in turn (``unschedulable_pod``)
    reasons: tuple[str, ...] = ("affinity",)
    #: seconds of the tenant's pods before the first ordinary pod, and between ordinary pods
    lead: float = 6.0
    spacing: float = 3.0
    ordinary: int = 1
    ordinary_memory: str = "4Gi"
    #: seconds an ordinary pod is waited for before it counts as never allocated (infinite wait)
    give_up: float = 10.0
    #: whether time moves on only once the allocator's watches show each pod created (simulated time: the
    #: watches' real delay is no part of what is measured there)
    shown_first: bool = False
    #: what the case saw: each ordinary pod's seconds from creation to ungated, the tenant's pods created,
    #: and the most memory units the fence kept on one GPU
    waits: list[float] = field(default_factory=list)
    tenant_pods: int = 0
    most_kept: int = 0

    async def run(self) -> list[float]:
        allocator = self.world.allocator
        start = self.clock()
        next_tenant, next_ordinary = start, start + self.lead
        created: dict[str, float] = {}
        made = 0
        while len(self.waits) < self.ordinary:
            now = self.clock()
            if now >= next_tenant:
                name = f"tenant-{self.tenant_pods}"
                self.api.create(claim(name, memory=self.tenant_memory))
                reason = self.reasons[self.tenant_pods % len(self.reasons)]
                self.api.create(unschedulable_pod(name, name, reason=reason))
                await self._shown(name)
                self.tenant_pods, next_tenant = self.tenant_pods + 1, next_tenant + self.every
            if made < self.ordinary and now >= next_ordinary:
                name = f"ordinary-{made}"
                self.api.create(claim(name, memory=self.ordinary_memory))
                self.api.create(gated_pod(name, name))
                await self._shown(name)
                created[name], made, next_ordinary = now, made + 1, next_ordinary + self.spacing
            allocator.step()
            await allocator.settle()
            kept = allocator.fence.kept
            self.most_kept = max([self.most_kept, *(room.units for rooms in kept.values() for room in rooms.values())])
            for name, when in list(created.items()):
                if not gates(self.api, name):
                    self.waits.append(self.clock() - when)
                    del created[name]
                elif self.clock() - when > self.give_up:
                    self.waits.append(math.inf)
                    del created[name]
            await self.tick()
        return self.waits

    async def _shown(self, name: str, *, within: float = 30.0) -> None:
        """With ``shown_first``: until the allocator's cache and claim cache show the pod and its claim."""
        allocator, claim_cache = self.world.allocator, self.world.claim_cache
        deadline = time.monotonic() + within
        while self.shown_first and (
            ("default", name) not in allocator.cache.claiming or name not in claim_cache.claims.get("default", {})
        ):
            if time.monotonic() > deadline:
                raise AssertionError(f"the allocator's watches did not show pod {name} within {within} s")
            allocator.cache.inbox.drain()
            claim_cache.drain()
            await asyncio.sleep(0.005)
