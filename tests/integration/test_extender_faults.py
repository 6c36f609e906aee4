"""The extender against an API server that stalls, loses answers and lands writes late, and against callers
that are not kube-scheduler: no GPU ever ends over its memory, and nothing bad gets past the front door."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.builders import pod
from tests.extender_harness import Extender, gpushared_cluster
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.harness import wait_until


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        gpushared_cluster(server)  # n1: GPUs of 16 and 8 GiB
        yield server


def used(extender: Extender) -> list[int]:
    _, inspect = extender.inspect("n1")
    return [d["usedGPU"] for d in inspect["nodes"][0]["devs"]]


def bound_on_n1(api: FakeApiServer) -> list[dict[str, Any]]:
    return [p for p in api.objects("pods") if p["spec"].get("nodeName") == "n1"]


def test_a_stalled_watch_gives_no_bound_memory_away(api: FakeApiServer, spawn: Callable[..., Extender]) -> None:
    """The pod watch stays open and silent while Bindings succeed: every bind is read back and stays
    counted, the watch is relisted, and /readyz says the cache is stale once the watch has been silent past
    its bound."""
    extender = spawn(api, args=["--watch-seconds", "5"])
    extender.wait_ready()
    api.stall_watches()
    first = api.create(pod("first", 10))
    assert extender.bind(first, "n1")[1] == {"Error": ""}
    # Longer than the read-back delay and a settle round: before the fix, a release after ASSUME_SECONDS.
    wait_until(lambda: "listing again" in extender.log(), timeout=20, message="the lag seen by a read-back")
    second = api.create(pod("second", 10))
    _, result = extender.bind(second, "n1")
    assert "does not fit node n1" in result["Error"] or "stale" in result["Error"], result
    wait_until(lambda: extender.get("/readyz")[0] == 503, timeout=30, message="stale readyz")
    assert b"stale" in extender.get("/readyz")[1]
    assert b"gpushared_extender_cache_stale 1.0" in extender.get("/metrics")[1]
    api.stall_watches(False)
    wait_until(lambda: extender.get("/readyz")[0] == 200, timeout=30, message="fresh again")
    assert sum(p["metadata"]["name"] == "second" for p in bound_on_n1(api)) == 0
    assert used(extender) == [10, 0]


@pytest.mark.parametrize("how", ["cut", "delay"])
def test_a_binding_whose_answer_is_lost_but_lands_is_not_double_booked(
    api: FakeApiServer, spawn: Callable[..., Extender], how: str
) -> None:
    """The Binding is applied, then its answer is cut (or comes after the client gave up): its memory stays
    reserved until the pod is read back, so a second pod cannot take it."""
    extender = spawn(api)
    extender.wait_ready()
    first = api.create(pod("first", 16))
    fault = Fault(method="POST", path=r"/pods/first/binding$", applied=True)
    if how == "cut":
        fault.cut = True
    else:
        fault.delay, fault.status = 11.0, 504  # past the client's 10 s
    api.inject(fault)
    _, result = extender.bind(first, "n1")
    assert "got no answer" in result["Error"], result
    assert api.get("pods", "first", "default")["spec"]["nodeName"] == "n1"  # type: ignore[index]
    second = api.create(pod("second", 16))
    _, result = extender.bind(second, "n1")
    assert "does not fit node n1" in result["Error"], result
    assert used(extender) == [16, 0]
    assert [p["metadata"]["name"] for p in bound_on_n1(api)] == ["first"]


def test_an_unanswered_binding_that_never_lands_is_released_after_its_window(
    api: FakeApiServer, spawn: Callable[..., Extender]
) -> None:
    extender = spawn(api, args=["--binding-landing-seconds", "3"])
    extender.wait_ready()
    first = api.create(pod("first", 16))
    api.inject(Fault(method="POST", path=r"/pods/first/binding$", status=500, message="etcd hiccup"))
    _, result = extender.bind(first, "n1")
    assert "got no answer" in result["Error"], result
    assert used(extender) == [16, 0]  # it may land yet
    wait_until(lambda: used(extender) == [0, 0], timeout=15, message="released after the landing window")
    assert extender.bind(api.get("pods", "first", "default"), "n1")[1] == {"Error": ""}  # type: ignore[arg-type]
