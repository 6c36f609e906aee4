"""Ranked locks: taken in increasing rank only, so the extender's threads cannot wait on each other in a
cycle (issue #39, defect 2: the event loop in ``ClusterCache.settle`` held the cache's lock and waited for
the pod informer's; the informer held its own and, in its handler, waited for the cache's)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from gpushared.core.binding import bind_annotations
from gpushared.core.requests import pod_request
from gpushared.extender.reservations import Assumed
from gpushared.kube.locks import CACHE, INFORMER, LockOrderError, RankedLock, held
from tests.builders import inventory, pod
from tests.extender_harness import gpu_node
from tests.unit.test_cache import fed_by_hand


def test_locks_are_taken_in_increasing_rank_only() -> None:
    outer, inner = RankedLock("informer", INFORMER), RankedLock("cache", CACHE)
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

    def later() -> None:
        time.sleep(0.05)
        with condition:
            ready.append(1)
            condition.notify_all()

    threading.Thread(target=later).start()
    with condition:
        assert condition.wait_for(lambda: ready, timeout=5)
        assert held() == ("informer",)
    assert held() == ()


def test_settling_a_bind_while_the_watch_delivers_cannot_deadlock() -> None:
    """The pod informer applies events (its lock, then the cache's in the handler) while the event loop
    settles read-back binds, for a second on two threads. Before the fix ``settle`` took the two locks the
    other way round: a LockOrderError at its first call here, and a deadlock within 30-42 s under the fault
    suite's Bindings answered 500."""
    cache = fed_by_hand(clock=time.monotonic)
    cache.nodes.handler(None, gpu_node("n1", inv=inventory(16, 16), cpu="8"))  # type: ignore[misc]
    bodies = [pod(f"p{i}", 1) for i in range(20)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def watch() -> None:
        informer: Any = cache.pods
        version = 1
        while not stop.is_set():
            for body in bodies:
                version += 1
                bound = {**body, "metadata": {**body["metadata"], "resourceVersion": str(version)}}
                bound["spec"] = {**body["spec"], "nodeName": "n1"}
                annotations = bind_annotations(
                    pod_request(body), [inventory(16, 16).gpus[0]], unit=inventory(16).unit, now_ns=1
                )
                bound["metadata"]["annotations"] = annotations
                try:
                    informer._apply({"type": "MODIFIED", "object": bound}, str(version))
                    informer._apply({"type": "DELETED", "object": bound}, str(version))
                except BaseException as exc:
                    errors.append(exc)
                    return

    def settle() -> None:
        while not stop.is_set():
            for body in bodies:
                meta = body["metadata"]
                assumed = Assumed(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], node="n1", since=0)
                try:
                    cache.settle(assumed, None)
                except BaseException as exc:
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=watch), threading.Thread(target=settle)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive(), "deadlocked"
    assert errors == []
