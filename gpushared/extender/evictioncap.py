"""The cap on evictions for preemptors: at most so many pods a minute for the preemptors of one namespace.

One cap serves every path that evicts for a preemptor (the ``preempt`` verb's answers, the extender's own
evictions, the claim allocator's), so one tenant's high-priority pods cannot churn the others' pods without
end, by any of them. ``--max-evictions-per-minute``; 0 turns preemption off.
"""

from __future__ import annotations

from collections import deque

#: The most pods evicted a minute for the preemptors of one namespace, by default (``--max-evictions-per-minute``).
MAX_EVICTIONS_PER_MINUTE = 20
#: The window the cap counts over.
WINDOW_SECONDS = 60.0


class EvictionCap:
    def __init__(self, per_minute: int = MAX_EVICTIONS_PER_MINUTE) -> None:
        self.per_minute = per_minute
        #: per namespace of preemptors, (when, how many evicted) in the last minute
        self.evicted: dict[str, deque[tuple[float, int]]] = {}

    def may_evict(self, namespace: str, now: float) -> bool:
        """Whether the preemptors of ``namespace`` may have pods evicted now (under the cap for the minute).
        Windows emptied meanwhile are dropped: what is kept is bounded by the namespaces evicting this minute."""
        for name in list(self.evicted):
            window = self.evicted[name]
            while window and now - window[0][0] >= WINDOW_SECONDS:
                window.popleft()
            if not window:
                del self.evicted[name]
        return sum(count for _, count in self.evicted.get(namespace, ())) < self.per_minute

    def count(self, namespace: str, now: float, evictions: int) -> None:
        self.evicted.setdefault(namespace, deque()).append((now, evictions))
