"""What the leader's workers on gated pods share. The claim allocator (``extender.claims.allocator``) and the
steerer (``extender.steering``) each take the pods the webhook gated, decide for them on the event loop, and
write in tasks of their own: a pod being written is not decided again meanwhile (``inflight``), each pod's
wait is timed from when the worker first saw it gated (``first_seen``, ``latencies``), what is kept per pod
is bounded by the pods still waiting (``forget_gone``), and a patch refused because the pod changed is tried
once more on the pod read again (``patch_pod``).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, NamedTuple

from gpushared.core.shared.bodies import Key, PodBody, key_of, uid_of
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.errors import KubeError

#: The most waits kept for the latency figures: the newest.
MAX_LATENCIES = 10_000


class GatedPodWorker:
    #: how often :meth:`run` steps, while this replica leads and its cache is ready
    tick_seconds = 0.1

    def step(self) -> int:
        """Decide for the pods waiting and start what must be written; how many pods it started for."""
        raise NotImplementedError

    async def run(self, *, leading: Callable[[], bool], ready: Callable[[], bool]) -> None:
        while True:
            if leading() and ready():
                self.step()
            await asyncio.sleep(self.tick_seconds)

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        #: pods being written (their claims, their gate, their patch): not decided again meanwhile
        self.inflight: set[Key] = set()
        #: pod UID -> when the worker first saw it gated (its latency; the allocator's opt-in timeout)
        self.first_seen: dict[str, float] = {}
        #: seconds from first seen gated to ungated, per pod the worker placed (the latency figures' source)
        self.latencies: list[float] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Awaitable[None]) -> None:
        """Run ``work`` in a task of its own, kept until it ends (``settle`` waits for them)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for every write started (tests; a clean stop)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def waited(self, uid: str) -> None:
        """The pod was ungated by this worker: its wait since first seen joins the latencies."""
        started = self.first_seen.pop(uid, None)
        if started is not None:
            self.latencies.append(self.clock() - started)
            del self.latencies[:-MAX_LATENCIES]

    def forget_gone(self, waiting: Iterable[PodBody], kept: Iterable[MutableMapping[str, Any]], *, most: int) -> None:
        """Drop, from each of ``kept`` (pod UID -> anything), the pods no longer ``waiting``, once together they
        hold more than ``most`` entries: what is kept per pod stays bounded by the pods waiting."""
        books = list(kept)
        if sum(len(book) for book in books) <= most:
            return
        alive = {uid_of(pod) for pod in waiting}
        for book in books:
            for uid in [uid for uid in book if uid not in alive]:
                del book[uid]


class Patched(enum.Enum):
    DONE = "done"
    #: nothing to patch: the pod as read needs no change (its gate went already)
    NOTHING = "nothing"
    #: the pod is gone, or deleted and made again (another UID): not the pod decided
    GONE = "gone"
    #: the read failed (``error``): tried again at the next step
    UNREAD = "unread"
    #: the patch failed other than by a change of the pod (``error``), or the pod changed twice
    FAILED = "failed"


class Patch(NamedTuple):
    outcome: Patched
    #: the pod the operations were worked out from, where they were
    pod: PodBody | None = None
    error: KubeError | None = None


async def patch_pod(
    api: AsyncApi,
    pod: PodBody,
    operations_of: Callable[[PodBody], list[dict[str, Any]] | None],
    *,
    read_first: bool,
) -> Patch:
    """Apply to the pod the JSON Patch ``operations_of`` works out from it (None: nothing to do). The operations
    carry their own guards (the pod's UID, the place of what they change): a patch the API server refuses
    because the pod changed (409, 422) is worked out again from the pod read again, and tried once more.
    ``read_first``: work it out from the pod as the API server has it, not from ``pod`` (the cache's, slimmed)."""
    namespace, name = key_of(pod)
    uid = uid_of(pod)
    current: PodBody | None = None if read_first else pod
    for _ in range(2):
        if current is None:
            try:
                current = await api.get_pod(namespace, name)
            except KubeError as exc:
                return Patch(Patched.GONE) if exc.status == 404 else Patch(Patched.UNREAD, error=exc)
            if uid_of(current) != uid:
                return Patch(Patched.GONE)
        operations = operations_of(current)
        if operations is None:
            return Patch(Patched.NOTHING, current)
        try:
            await api.json_patch_pod(namespace, name, operations)
        except KubeError as exc:
            if exc.status == 404:
                return Patch(Patched.GONE)
            if exc.status not in (409, 422):
                return Patch(Patched.FAILED, current, exc)
            current = None
            continue
        return Patch(Patched.DONE, current)
    return Patch(Patched.FAILED)
