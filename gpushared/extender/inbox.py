"""How informer threads hand the cluster's changes to the one owner of the extender's state.

The extender's cluster state (``cache.ClusterCache`` and what it holds) has one owner: the thread that
runs the event loop, where every verb and background task runs too. Nothing takes a lock on that state.
The informers list and watch on threads of their own (a blocking HTTP client and a JSON decode per event);
each change they see is put here, and the owner applies it, in order, on its own thread — as
kube-scheduler's informers hand events to its single scheduling loop through its cache's handlers.

:class:`Inbox` is a deque (appends and pops are atomic in CPython) and, once a loop is attached, one
callback scheduled on it whenever changes are waiting. The owner applies at most ``BATCH`` changes per
turn of the loop, so a relist of 150,000 pods never holds a verb up for more than one batch.

:class:`Owner` says which thread that is, and refuses every other: each entry point of the cache checks
it (``tests/unit/test_ownership.py``), so a call from a wrong thread fails at once instead of racing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Changes applied per turn of the event loop; about 2 ms of the owner's time at most.
BATCH = 1000


class OwnershipError(RuntimeError):
    """The extender's state was touched from a thread that does not own it."""


class Owner:
    """The thread that owns the state: the first to :meth:`claim` it (the event loop's, in the extender;
    a test's own, where no loop runs). Before a claim any thread may act: a cache being filled by hand."""

    def __init__(self) -> None:
        self._ident: int | None = None
        self._name = ""

    def claim(self) -> None:
        """The calling thread owns the state from now on."""
        self._ident, self._name = threading.get_ident(), threading.current_thread().name

    def check(self, what: str) -> None:
        if self._ident is not None and threading.get_ident() != self._ident:
            raise OwnershipError(
                f"{what} on thread {threading.current_thread().name!r}: the extender's state belongs to "
                f"thread {self._name!r}; hand changes over through the inbox"
            )


#: A change: (which informer, old object, new object), as the informer's handler was called.
Change = tuple[str, Any, Any]


class Inbox:
    """Changes from the informers' threads, waiting for the owner (``apply`` is called with each)."""

    def __init__(self, apply: Callable[[str, Any, Any], None], owner: Owner) -> None:
        self._apply = apply
        self._owner = owner
        self._waiting: collections.deque[Change] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        #: changes applied since the start
        self.applied = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def handler(self, kind: str) -> Callable[[Any, Any], None]:
        """An informer's handler: runs on the informer's thread, and only puts the change here."""

        def put(old: Any, new: Any) -> None:
            self._waiting.append((kind, old, new))
            loop = self._loop
            if loop is not None and not self._scheduled:
                self._scheduled = True  # set before the callback can clear it; at worst one callback too many
                with contextlib.suppress(RuntimeError):  # the loop closed: the extender is stopping
                    loop.call_soon_threadsafe(self._turn)

        return put

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on, changes are applied on ``loop`` as they arrive (what waits already, at once)."""
        self._loop = loop
        self._scheduled = True
        loop.call_soon_threadsafe(self._turn)

    def drain(self, limit: int | None = None) -> int:
        """Apply the changes waiting (at most ``limit``), on the owner's thread; how many were applied."""
        self._owner.check("applying the informers' changes")
        waiting, apply = self._waiting, self._apply
        done = 0
        while waiting and (limit is None or done < limit):
            kind, old, new = waiting.popleft()
            try:
                apply(kind, old, new)
            except Exception:  # one change the cache cannot take must not stop the others
                log.exception("%s: applying a change failed", kind)
            done += 1
        self.applied += done
        return done

    def _turn(self) -> None:
        """One turn of the loop's: a batch, and another turn later if more wait."""
        self._scheduled = False  # before draining: a change put during the drain schedules another turn
        self.drain(BATCH)
        loop = self._loop
        if self._waiting and not self._scheduled and loop is not None:
            self._scheduled = True
            loop.call_soon(self._turn)
