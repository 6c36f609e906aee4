"""Pricing a request before kube-scheduler asks for it: the first pod of a new size, seen pending.

A node's rank for a pod is kept in its memo per slot (``index.RankSlot``: the request size, the pod's CPU
for a policy that reads it, the mix the rank read) until its ledger changes. So the first prioritize (or
ranking filter) of a slot prices every candidate — a thousand nodes, about 3 ms of Python — and the calls
after it only the nodes a bind changed since. Those cold calls are few (one per new size) but they are the
p99 (docs/benchmarks.md, "Prioritize on a cold cache").

The pod's watch event reaches the extender about when it reaches kube-scheduler, and kube-scheduler runs its
own queue, filter and score plugins before it calls the extender; when pods come in bursts, the pods behind
the first wait in its queue. The primer uses that time: the cache hands it every pod the watch shows
pending (``ClusterCache.pending_seen``), and on the event loop, between the verbs, it prices a slot not
primed before on every node, a few dozen nodes per turn of the loop so that a verb arriving meanwhile waits
for one chunk at most. A verb that comes before the primer is done prices the rest itself, as it would have
without it: priming never makes an answer different, only earlier.

What anyone allowed to create pods can make it do is bounded: a pod is looked at once per event, a slot is
priced once, a pod offered more than ``STALE_SECONDS`` ago is passed over (kube-scheduler has most likely
asked about it already), and the primer takes at most ``SHARE`` of the event loop's time (``pacing``), so
a flood of pending pods of distinct sizes (a tenant's, or a cluster counting in MiB) slows the verbs by at
most that share and never stalls them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

from gpushared.contract import ContractError, ResourceNames
from gpushared.core.placement.policies import Policy
from gpushared.core.shared.bodies import PodBody
from gpushared.core.shared.requests import pod_request
from gpushared.extender.cache import ClusterCache
from gpushared.extender.index import PRICES_PER_TURN, RankSlot

log = logging.getLogger(__name__)

#: Nodes priced per turn of the event loop: what a verb waits for the primer at most (as for a paced verb).
CHUNK = PRICES_PER_TURN
#: Pending pods waiting to be looked at; past it the oldest are dropped (a burst of one Deployment's pods
#: is one slot many times over).
QUEUE = 4096
#: Slots remembered as primed, newest kept.
REMEMBERED = 1024
#: How often the primer looks whether the cache has synced, before it starts.
READY_POLL_SECONDS = 0.05
#: A pod offered longer ago than this is not priced: its scheduling cycle has most likely passed.
STALE_SECONDS = 2.0
#: The most of the event loop's time the primer takes over a while, and what it may take at once (one size
#: on 5,000 nodes, about 15 ms) before that share applies.
SHARE = 0.25
BURST_SECONDS = 0.02


def pacing(owed: float, elapsed: float, *, share: float = SHARE, burst: float = BURST_SECONDS) -> tuple[float, float]:
    """A leaky bucket: ``owed`` is the pricing time the primer has spent and not yet paid back, which
    ``elapsed`` seconds of wall time pay back at ``share``. Returns what is still owed and how long to pause
    before the next chunk, so that the primer's time stays within ``burst`` plus ``share`` of the wall time."""
    owed = max(0.0, owed - elapsed * share)
    return owed, max(0.0, (owed - burst) / share)


class Primer:
    def __init__(
        self,
        cache: ClusterCache,
        *,
        policy: Policy,
        resources: ResourceNames,
        ready: Callable[[], bool],
        chunk: int = CHUNK,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.cache, self.policy, self.resources = cache, policy, resources
        self.ready = ready
        self.chunk = chunk
        self.clock, self.sleep = clock, sleep
        self._seen: collections.deque[tuple[float, PodBody]] = collections.deque(maxlen=QUEUE)
        self._owed, self._paced_at = 0.0, clock()
        #: seconds the primer paused to stay within its share, since the start
        self.paused_seconds = 0.0
        self._primed: dict[RankSlot, None] = {}  # insertion-ordered: the oldest is dropped first
        self._wake: asyncio.Event | None = None
        #: slots priced ahead on every node, since the start
        self.slots_primed = 0

    def offer(self, pod: PodBody) -> None:
        """A pod the watch shows pending; called by the cache as it applies the event, so it only queues
        the pod, to be priced between the verbs."""
        self._seen.append((self.clock(), pod))
        if self._wake is not None:
            self._wake.set()

    def waiting(self) -> int:
        """Pods offered and not looked at yet."""
        return len(self._seen)

    async def run(self) -> None:
        """Price what the queue brings, forever; from the first time the cache is ready (a slot primed on a
        half-listed cluster would be remembered as primed)."""
        self._wake = asyncio.Event()
        while not self.ready():
            await self.sleep(READY_POLL_SECONDS)
        self._wake.set()  # what was offered while the cache synced
        while True:
            await self._wake.wait()
            self._wake.clear()  # before the drain: a pod offered during it sets it again, or is drained
            while self._seen:
                offered, pod = self._seen.popleft()
                if self.clock() - offered > STALE_SECONDS:
                    continue
                try:
                    await self.prime(pod)
                except Exception:  # priming is an optimisation: a failure must not end it for good
                    log.exception("pricing a pending pod ahead failed")

    async def prime(self, pod: PodBody) -> bool:
        """Price the pod's slot on every node unless it was primed before; whether it priced."""
        try:
            request = pod_request(pod, resources=self.resources)
        except ContractError:
            return False  # filter says why; nothing to price
        if request.total <= 0:
            return False  # not a GPU pod: prioritize-no-gpu reads no memo
        cache, policy = self.cache, self.policy
        slot = cache.index.slot(pod, request, policy)
        if slot in self._primed:
            return False
        self._primed[slot] = None
        if len(self._primed) > REMEMBERED:
            del self._primed[next(iter(self._primed))]
        names = cache.state.node_names()
        for start in range(0, len(names), self.chunk):
            await self._pace()
            began = self.clock()
            cache.index.node_ranks(names[start : start + self.chunk], pod, request, policy)
            self._owed += self.clock() - began
        self.slots_primed += 1
        return True

    async def _pace(self) -> None:
        """Before each chunk: let a verb that arrived meanwhile go first, and pause while the primer has
        taken more than its share of the loop (``pacing``)."""
        await asyncio.sleep(0)
        now = self.clock()
        self._owed, pause = pacing(self._owed, now - self._paced_at)
        self._paced_at = now
        if pause > 0:
            self.paused_seconds += pause
            await self.sleep(pause)
