"""Which GPUs are healthy: XID and ECC events take a GPU out, a quiet period brings it back.

NVIDIA's plugin never lets a GPU recover, so one stray XID costs a node its GPU until a restart. Here a
GPU is unhealthy for ``recover_after`` seconds after its last critical event; which events are critical
is ``core.node.health.judge_event``'s table (application XIDs and corrected ECC errors are not). When
NVML fails on one GPU (GPU_IS_LOST on its memory info), that GPU alone is unhealthy, as after an event;
when NVML itself fails we cannot see the GPUs at all, so all of them are unhealthy until it answers again.
A GPU whose MPS control daemon does not answer is unhealthy for as long as that lasts (a condition, not
an event: it clears the moment the daemon answers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpushared.core.node.health import EventVerdict, judge_event

_NVML_FAILED = "NVML failed on this GPU"


@dataclass(frozen=True)
class Mark:
    reason: str
    since: float


class Health:
    def __init__(
        self, *, ignored_xids: Iterable[int], recover_after: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ignored = frozenset(ignored_xids)
        self.recover_after = recover_after
        self.clock = clock
        self._lock = threading.Lock()
        self._marks: dict[str, Mark] = {}  # GPU UUID -> last critical event
        self._conditions: dict[str, str] = {}  # GPU UUID -> why it is unusable right now
        self._backend_down: Mark | None = None
        self._backend_back: float | None = None

    def event(self, uuid: str | None, *, kind: str, xid: int, all_uuids: Iterable[str]) -> EventVerdict:
        """Record an event as ``core.node.health.judge_event`` rules; ``uuid`` None means the driver could not say
        which GPU (then it counts for all of them)."""
        verdict = judge_event(kind, xid, ignored_xids=self.ignored, recover_after=self.recover_after)
        if not verdict.counts:
            return verdict
        now = self.clock()
        with self._lock:
            for target in [uuid] if uuid else list(all_uuids):
                self._marks[target] = Mark(reason=verdict.reason, since=now)
        return verdict

    def gpu_failed(self, uuid: str, reason: str) -> bool:
        """NVML failed on this one GPU: it is unhealthy until it has read well for the quiet period, as after
        a critical event. True when it was healthy until now."""
        with self._lock:
            mark = self._marks.get(uuid)
            fresh = mark is None or not mark.reason.startswith(_NVML_FAILED)
            self._marks[uuid] = Mark(reason=f"{_NVML_FAILED}: {reason}", since=self.clock())
        return fresh

    def backend_failed(self, reason: str) -> None:
        with self._lock:
            if self._backend_down is None:
                self._backend_down = Mark(reason=f"NVML failed: {reason}", since=self.clock())
            self._backend_back = None

    def backend_ok(self) -> None:
        with self._lock:
            if self._backend_down is not None and self._backend_back is None:
                self._backend_back = self.clock()

    def condition(self, uuid: str, reason: str | None) -> None:
        """Set (reason) or clear (None) a condition that makes the GPU unusable until cleared."""
        with self._lock:
            if reason is None:
                self._conditions.pop(uuid, None)
            else:
                self._conditions[uuid] = reason

    def problem(self, uuid: str) -> str | None:
        """Why the GPU is unhealthy now, or None."""
        now = self.clock()
        with self._lock:
            if uuid in self._conditions:
                return self._conditions[uuid]
            if self._backend_down is not None:
                if self._backend_back is None or now - self._backend_back < self.recover_after:
                    return self._backend_down.reason
                self._backend_down = self._backend_back = None
            mark = self._marks.get(uuid)
            if mark is None:
                return None
            if now - mark.since >= self.recover_after:
                del self._marks[uuid]
                return None
            return mark.reason
