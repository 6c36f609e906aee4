"""The informer against the fake API server: list, watch, resume, relist after 410 or a cut stream."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from gpushared.kube.informer import Informer
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.harness import node_body, wait_until


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


class Recorder:
    def __init__(self) -> None:
        self.changes: list[tuple[str | None, str | None]] = []
        self.lock = threading.Lock()

    def __call__(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        with self.lock:
            self.changes.append((old["metadata"]["name"] if old else None, new["metadata"]["name"] if new else None))


def start(api: FakeApiServer, recorder: Recorder, **kwargs: Any) -> Informer:
    informer = Informer(api.rest().lister("/api/v1/nodes", what="nodes"), name="nodes", handler=recorder, **kwargs)
    informer.start()
    assert informer.wait_synced(5)
    return informer


def names(informer: Informer) -> list[str]:
    return sorted(o["metadata"]["name"] for o in informer.objects())


def test_list_then_watch(api: FakeApiServer) -> None:
    api.create(node_body("a"))
    recorder = Recorder()
    informer = start(api, recorder)
    assert names(informer) == ["a"]
    api.create(node_body("b"))
    core = client.CoreV1Api(api.client())
    core.patch_node("a", {"metadata": {"labels": {"x": "y"}}})
    core.delete_node("b")
    wait_until(lambda: names(informer) == ["a"] and informer.get("", "a")["metadata"]["labels"].get("x") == "y")  # type: ignore[index]
    assert recorder.changes == [(None, "a"), (None, "b"), ("a", "a"), ("b", None)]
    # Its count of changes is what the daemon compares to know the mirror is as it was (Service._report).
    assert informer.changes == len(recorder.changes)
    informer.stop()


def test_a_410_relists_and_reports_what_changed_meanwhile(api: FakeApiServer) -> None:
    for name in ("a", "b"):
        api.create(node_body(name))
    recorder = Recorder()
    informer = start(api, recorder)
    wait_until(lambda: api.open_watches == 1, message="watching")  # the 410 must hit an open watch
    # While no watch is open (every watch gets 410 until the fault is used up), b goes and c comes.
    api.inject(Fault(path=r"/nodes$", watch=True, status=410, times=3))
    api.expire_watches()
    core = client.CoreV1Api(api.client())
    core.delete_node("b")
    api.create(node_body("c"))
    api.compact()
    wait_until(lambda: names(informer) == ["a", "c"], message="relisted")
    assert ("b", None) in recorder.changes
    assert (None, "c") in recorder.changes
    assert informer.relists >= 2
    informer.stop()


def test_a_cut_stream_is_resumed_without_losing_events(api: FakeApiServer) -> None:
    api.create(node_body("a"))
    informer = start(api, Recorder())
    wait_until(lambda: api.open_watches == 1, message="watching")
    api.cut_watches()
    api.create(node_body("late"))
    wait_until(lambda: names(informer) == ["a", "late"], message="caught up")
    informer.stop()


def test_the_api_server_down_at_start(api: FakeApiServer) -> None:
    api.create(node_body("a"))
    outage = api.inject(Fault(status=503, times=None))
    informer = Informer(api.rest().lister("/api/v1/nodes", what="nodes"), name="nodes")
    informer.start()
    assert not informer.wait_synced(1)
    api.faults.remove(outage)
    assert informer.wait_synced(10)
    assert names(informer) == ["a"]
    informer.stop()


def test_remember_keeps_the_newer_copy(api: FakeApiServer) -> None:
    api.create(node_body("a"))
    informer = start(api, Recorder())
    current = informer.get("", "a")
    assert current is not None
    stale = {**current, "metadata": {**current["metadata"], "resourceVersion": "1", "labels": {"stale": "1"}}}
    before = informer.changes
    informer.remember(stale)
    assert informer.get("", "a") == current
    assert informer.changes == before  # nothing kept, nothing changed
    informer.remember({**current, "metadata": {**current["metadata"], "resourceVersion": "999999"}})
    assert informer.changes == before + 1
    informer.stop()


def test_lists_in_pages_and_keeps_only_what_the_transform_leaves(api: FakeApiServer) -> None:
    for i in range(1201):
        api.create(node_body(f"n{i:04d}"))
    informer = start(api, Recorder(), transform=lambda node: {"metadata": node["metadata"]})
    try:
        assert len(informer.objects()) == 1201
        assert all(set(o) == {"metadata"} for o in informer.objects())
        lists = [r for r in api.requests if r.method == "GET" and r.path.endswith("/nodes") and "watch" not in r.query]
        assert [r.query.get("limit") for r in lists] == ["500", "500", "500"]
        api.create(node_body("late"))
        wait_until(lambda: "late" in names(informer), message="watched after the paged list")
    finally:
        informer.stop()
