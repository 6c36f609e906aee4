"""Ranked locks: taken in increasing rank only, so threads cannot wait on each other in a cycle (issue #39,
defect 2: the extender's event loop held the cache's lock and waited for the pod informer's; the informer
held its own and, in its handler, waited for the cache's). The extender's state has no lock at all now
(``test_ownership.py``); the informers' mirrors still take ranked ones."""

from __future__ import annotations

import threading

import pytest

from gpushared.kube.locks import INFORMER, LockOrderError, RankedLock, held

#: a rank above the informers', as a lock their handlers take would have
HANDLER = INFORMER + 10


def test_locks_are_taken_in_increasing_rank_only() -> None:
    outer, inner = RankedLock("informer", INFORMER), RankedLock("cache", HANDLER)
    with outer, inner:
        assert held() == ("informer", "cache")
        with inner:  # re-entered: allowed
            pass
    with inner, pytest.raises(LockOrderError, match=r"taking informer .* while holding cache"):
        outer.acquire()
    assert held() == ()
    other = RankedLock("another informer", INFORMER)
    with outer, pytest.raises(LockOrderError):
        other.acquire()  # the same rank: never two at once


def test_a_ranked_lock_serves_a_condition() -> None:
    condition = threading.Condition(RankedLock("informer", INFORMER))  # type: ignore[arg-type]
    ready: list[int] = []

    def later() -> None:  # before or after the wait below: wait_for's predicate holds either way
        with condition:
            ready.append(1)
            condition.notify_all()

    threading.Thread(target=later).start()
    with condition:
        assert condition.wait_for(lambda: ready, timeout=5)
        assert held() == ("informer",)
    assert held() == ()
