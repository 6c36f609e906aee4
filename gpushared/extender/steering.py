"""The steerer: CPU-only pods given the extender's choice of node where kube-scheduler calls no
extender (``core.placement.steering``; opt-in, ``--steer-cpu-pods``).

The webhook gates a new CPU-only pod in the namespaces an operator labelled. The leader, on the extender's
event loop, reads each such pod whole (its affinity decides the patch's paths), works out the nodes the
extender's ``prioritize-no-gpu`` ranks best among those the pod may use (``core.placement.nodefit``), and
in one JSON Patch, guarded by the pod's UID and resourceVersion, adds a preferred node affinity naming them
and removes the gate. A patch refused because the pod changed is tried once more on the pod read again; one
that fails otherwise is tried at the next step.

Fail open, within bounds: steering is a preference, never a reason to wait. The webhook gates only while a
leader holds the Lease (a replica that sees none lets pods through ungated, as with the extender down:
``failurePolicy: Ignore``); a pod gated just before its leader died is steered by the next one, once it
takes the Lease. No lock is held, and no call is made while deciding.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpushared.core.placement.claims.choice import Resources, kube_resource_score
from gpushared.core.placement.cpu import cpu_of, memory_request
from gpushared.core.placement.nodefit import admits
from gpushared.core.placement.steering import Preferred, SteerCandidate, preferred_terms, steer_operations
from gpushared.core.shared.bodies import Key, PodBody, key_of, uid_of
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.verdicts import idle_gpu_mib
from gpushared.extender.cache import ClusterCache
from gpushared.extender.claims.cache import ClaimCache
from gpushared.extender.gatedwork import GatedPodWorker, Patched, patch_pod
from gpushared.kube.aioapi import AsyncApi

log = logging.getLogger(__name__)

#: How often the leader looks at the gated pods.
TICK_SECONDS = 0.1
#: Pods being read and patched at once: a burst of gated pods is worked through this many at a time.
MAX_IN_FLIGHT = 32

LedgerOf = Callable[[str], Ledger | None]


class Steerer(GatedPodWorker):
    tick_seconds = TICK_SECONDS

    def __init__(
        self,
        cache: ClusterCache,
        api: AsyncApi,
        *,
        ledger_of: LedgerOf,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        """``ledger_of``: a node's GPUs with what holds them (the claims on a DRA node), or None."""
        super().__init__(clock)
        self.cache, self.api, self.ledger_of = cache, api, ledger_of
        self.rng = rng or random.Random()
        #: steered (a preference added), unsteered (every node the same to the extender: the gate only went)
        self.counts: Counter[str] = Counter()

    def step(self) -> int:
        """Start steering the gated pods not in flight, at most MAX_IN_FLIGHT at once; how many started."""
        self.cache.owner.check("the steerer's step")
        self.cache.inbox.drain()
        started = 0
        now = self.clock()
        for key, pod in list(self.cache.steering.items()):
            if len(self.inflight) >= MAX_IN_FLIGHT:
                break
            if key in self.inflight:
                continue
            self.first_seen.setdefault(uid_of(pod), now)
            self.inflight.add(key)
            self.spawn(self._steer(key, pod))
            started += 1
        waiting = self.cache.steering
        self.forget_gone(waiting.values(), [self.first_seen], most=2 * len(waiting) + 100)
        return started

    def decide(self, pod: PodBody) -> tuple[Preferred, ...]:
        """The preferred terms for the pod (none: no preference), from the cache as it is now."""
        pod_cpu, pod_memory = cpu_of(pod), memory_request(pod)
        nodes = self.cache.state.nodes
        candidates = []
        for name, node in nodes.items():
            cpu, memory, facts = node.cpu, node.memory_allocatable, node.facts
            if cpu is None or memory is None or facts is None:
                continue  # deleted, or not saying what it has: kube-scheduler judges it
            if cpu.requested + pod_cpu > cpu.allocatable or node.memory_requested + pod_memory > memory:
                continue
            if admits(facts, pod):
                candidates.append(SteerCandidate(name=name, idle=float(idle_gpu_mib(self.ledger_of(name)))))

        def kube_scores(name: str) -> float:
            node = nodes[name]
            cpu, memory = node.cpu, node.memory_allocatable
            if cpu is None or memory is None:
                return 0.0
            resources = Resources(cpu.allocatable, cpu.requested, memory, node.memory_requested)
            return kube_resource_score(resources, pod_cpu=pod_cpu, pod_memory=pod_memory)

        return preferred_terms(candidates, kube_score=kube_scores, shuffle=self.rng.shuffle)

    async def _steer(self, key: Key, seen: PodBody) -> None:
        namespace, name = key
        decided: list[tuple[Preferred, ...]] = []

        def operations_of(pod: PodBody) -> list[dict[str, Any]] | None:
            decided.append(self.decide(pod))
            return steer_operations(pod, decided[-1])

        try:
            patch = await patch_pod(self.api, seen, operations_of, read_first=True)
        finally:
            self.inflight.discard(key)
        if patch.outcome is Patched.DONE and patch.pod is not None:
            self._done(patch.pod, decided[-1])
        elif patch.outcome is Patched.UNREAD:
            log.info("pod %s/%s not read for steering (tried again): %s", namespace, name, patch.error)
        elif patch.outcome is Patched.FAILED and patch.error is not None:
            log.warning("pod %s/%s not steered (tried again): %s", namespace, name, patch.error)

    def _done(self, pod: PodBody, terms: tuple[Preferred, ...]) -> None:
        self.counts["steered" if terms else "unsteered"] += 1
        self.waited(uid_of(pod))
        named = ", ".join(f"{n} ({t.weight})" for t in terms for n in t.nodes)
        log.debug("pod %s/%s ungated, preferring %s", *key_of(pod), named or "no node")


def idle_ledger(cache: ClusterCache, claim_cache: ClaimCache | None) -> LedgerOf:
    """A node's ledger as the extender's ``prioritize-no-gpu`` should read it: on a node whose slices publish
    the driver's GPUs, the claims allocated there (``claims.cache.ClaimCache.ledger``); elsewhere the gpu-mem
    pods bound there. ``claim_cache``: the claim allocator's cache, or None (no DRA)."""

    def ledger_of(name: str) -> Ledger | None:
        node = cache.state.nodes.get(name)
        if node is None:
            return None
        if (
            claim_cache is not None
            and node.inventory is not None
            and not node.problem
            and name in claim_cache.published()
        ):
            return claim_cache.ledger(name, node.inventory)
        return node.ledger

    return ledger_of
