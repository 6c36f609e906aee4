"""Locks with a rank, so that two threads can never wait on each other.

The extender's informer threads once called their handlers while holding the informer's lock, and the handlers
took the cache's lock; a verb that held the cache's lock and then asked an informer for an object waited for
the informer's lock the other way round, and the two waited forever (the event loop and the pod
informer, 30-42 s into a fault run where Bindings answered 500). The extender's state has no lock now (one owner:
``extender/inbox.py``); the informers' mirrors keep theirs, ranked. A :class:`RankedLock` refuses, at once and
with both names, to be taken by a thread that already holds a lock of its rank or a higher one: locks are
taken in increasing rank only, so no cycle of waits can form. The refusal is an exception on the thread that
broke the order, which the tests (and the fault suite) see the first time that path runs, not the one time in
thousands that two threads interleave badly.

Ranks in use: ``INFORMER`` (each informer's mirror; handlers run under it). A lock a handler takes must
rank higher.
"""

from __future__ import annotations

import threading
from typing import Any

INFORMER = 10

_held = threading.local()


class LockOrderError(RuntimeError):
    """A thread asked for a lock of a rank no higher than one it holds."""


def _stack() -> list[RankedLock]:
    stack: list[RankedLock] | None = getattr(_held, "stack", None)
    if stack is None:
        stack = _held.stack = []
    return stack


def held() -> tuple[str, ...]:
    """The names of the ranked locks this thread holds, outermost first."""
    return tuple(lock.name for lock in _stack())


class RankedLock:
    """A re-entrant lock that is taken only by a thread holding no lock of its rank or higher. Usable as
    the lock of a :class:`threading.Condition` (it provides the owner checks a Condition needs)."""

    def __init__(self, name: str, rank: int) -> None:
        self.name = name
        self.rank = rank
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._count = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._owner != threading.get_ident():
            stack = _stack()
            if stack:
                highest = max(stack, key=lambda lock: lock.rank)
                if highest.rank >= self.rank:
                    raise LockOrderError(
                        f"lock order: taking {self.name} (rank {self.rank}) while holding {highest.name} "
                        f"(rank {highest.rank}); locks are taken in increasing rank only"
                    )
        if not self._lock.acquire(blocking, timeout):
            return False
        if self._count == 0:
            self._owner = threading.get_ident()
            _stack().append(self)
        self._count += 1
        return True

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError(f"{self.name}: released by a thread that does not hold it")
        self._count -= 1
        if self._count == 0:
            self._owner = None
            _stack().remove(self)
        self._lock.release()

    def __enter__(self) -> RankedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # What threading.Condition asks of its lock to wait and notify correctly on a re-entrant one.

    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident()

    def _release_save(self) -> int:
        count, self._count, self._owner = self._count, 0, None
        _stack().remove(self)
        for _ in range(count):
            self._lock.release()
        return count

    def _acquire_restore(self, count: int) -> None:
        for _ in range(count):
            self._lock.acquire()
        self._owner, self._count = threading.get_ident(), count
        _stack().append(self)
