"""The request mix taken off the event loop, so that building it holds up no verb.

A new mix is taken every ``state.MIX_SECONDS``; building it, with the view each node class prices from,
ran inside a filter, on the event loop. Here the loop copies what the mix is taken of (the kinds and their
counts, the nodes by class and by room: some thousand entries), a worker thread builds it
(``core.placement.mixbook.built_mix``), and the loop installs it at the first look after it is done. The state keeps
its one owner: the worker reads only the copies and hands back a new object no one else has seen.

Pricing the nodes again under the new mix stays on the loop, but never all at once: a verb prices the
nodes it ranks PRICES_PER_TURN per turn before it answers (``Scheduler.paced``). Measured:
docs/benchmarks.md, "What an expected mix costs".
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from gpushared.core.placement.fragmentation import NodeClass, NodeRoom, RequestMix
from gpushared.core.placement.mixbook import MixBook, built_mix


class MixTaker:
    def __init__(self, book: MixBook) -> None:
        self.book = book
        self._pool: ThreadPoolExecutor | None = None
        self._building: Future[RequestMix] | None = None

    def start(self, *, nodes: Mapping[NodeClass, int], rooms: Mapping[NodeRoom, int] | None) -> None:
        """Take a new mix of the book's counts now, unless one is being built."""
        if self._building is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="request-mix")
        counts = self.book.counts()
        self._building = self._pool.submit(
            built_mix,
            counts,
            nodes=dict(nodes),
            rooms=None if rooms is None else dict(rooms),
            unseen=self.book.unseen,
        )

    def collect(self) -> None:
        """Install the mix built since the last look, if it is done (on the owner's thread)."""
        building = self._building
        if building is not None and building.done():
            self._building = None
            self.book.install(building.result())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
