"""The fake API server, driven by the real ``kubernetes`` client as every gpushared component drives it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.builders import GPU_MEM, pod
from tests.fakes.apiserver import FakeApiServer, Fault


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def core(api: FakeApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(api.client())


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "status": {}}


def test_create_get_list_with_field_and_label_selectors(core: client.CoreV1Api) -> None:
    core.create_node(node("n1", gpushare="true"))
    core.create_node(node("n2"))
    for name, where in (("a", "n1"), ("b", "n2"), ("c", "n1")):
        core.create_namespaced_pod("default", pod(name, 1, node=where))
    core.create_namespaced_pod("other", pod("d", 1, namespace="other", node="n1"))
    got = core.read_namespaced_pod("a", "default")
    assert got.metadata.uid and got.metadata.resource_version and got.status.phase == "Pending"
    on_n1 = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert sorted(p.metadata.name for p in on_n1.items) == ["a", "c", "d"]
    scoped = core.list_namespaced_pod("default", field_selector="spec.nodeName=n1,status.phase=Pending")
    assert sorted(p.metadata.name for p in scoped.items) == ["a", "c"]
    assert [n.metadata.name for n in core.list_node(label_selector="gpushare=true").items] == ["n1"]
    assert [n.metadata.name for n in core.list_node(label_selector="!gpushare").items] == ["n2"]
    assert [n.metadata.name for n in core.list_node(label_selector="gpushare in (true,yes)").items] == ["n1"]
    assert int(on_n1.metadata.resource_version) >= 6
    with pytest.raises(ApiException) as info:
        core.list_pod_for_all_namespaces(field_selector="spec.containers=x")
    assert info.value.status == 400
    with pytest.raises(ApiException) as info:
        core.read_namespaced_pod("missing", "default")
    assert info.value.status == 404
    with pytest.raises(ApiException) as info:
        core.create_namespaced_pod("default", pod("a", 1))
    assert info.value.status == 409


def test_paginated_list(core: client.CoreV1Api) -> None:
    for i in range(5):
        core.create_node(node(f"n{i}"))
    first = core.list_node(limit=2)
    assert len(first.items) == 2 and first.metadata._continue
    rest = core.list_node(limit=10, _continue=first.metadata._continue)
    assert [n.metadata.name for n in first.items + rest.items] == [f"n{i}" for i in range(5)]
    assert rest.metadata._continue is None


def test_stale_resource_version_is_a_409_conflict(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod("a", 2))
    stale = core.read_namespaced_pod("a", "default")
    core.patch_namespaced_pod("a", "default", {"metadata": {"annotations": {"x": "1"}}})
    stale.metadata.annotations = {"x": "2"}
    with pytest.raises(ApiException) as info:
        core.replace_namespaced_pod("a", "default", stale)
    assert info.value.status == 409
    assert "the object has been modified" in info.value.body
    with pytest.raises(ApiException) as info:
        core.patch_namespaced_pod(
            "a",
            "default",
            {"metadata": {"resourceVersion": stale.metadata.resource_version, "annotations": {"y": "1"}}},
        )
    assert info.value.status == 409
    fresh = core.read_namespaced_pod("a", "default")
    patched = core.patch_namespaced_pod(
        "a",
        "default",
        {"metadata": {"resourceVersion": fresh.metadata.resource_version, "annotations": {"y": "1"}}},
    )
    assert patched.metadata.annotations == {"x": "1", "y": "1"}
    assert int(patched.metadata.resource_version) > int(fresh.metadata.resource_version)


def test_three_patch_formats(core: client.CoreV1Api) -> None:
    body = pod("a", 2)
    body["spec"]["containers"].append({"name": "side", "image": "busybox"})
    core.create_namespaced_pod("default", body)
    # Strategic merge (the client's default for dict bodies): containers merge by name.
    core.patch_namespaced_pod("a", "default", {"spec": {"containers": [{"name": "side", "image": "busybox:2"}]}})
    images = [c.image for c in core.read_namespaced_pod("a", "default").spec.containers]
    assert images == ["busybox", "busybox:2"]
    # Merge patch: a list replaces, null deletes.
    core.patch_namespaced_pod(
        "a",
        "default",
        {"metadata": {"annotations": {"k": "v", "gone": None}}},
        _content_type="application/merge-patch+json",
    )
    core.patch_namespaced_pod(
        "a", "default", {"metadata": {"labels": {"app": "x"}}}, _content_type="application/merge-patch+json"
    )
    # JSON patch (the client picks it for list bodies), with a test op as an optimistic lock.
    current = core.read_namespaced_pod("a", "default")
    core.patch_namespaced_pod(
        "a",
        "default",
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": current.metadata.resource_version},
            {"op": "add", "path": "/metadata/annotations/ALIYUN_COM_GPU_MEM_IDX", "value": "1"},
            {"op": "remove", "path": "/metadata/annotations/k"},
        ],
    )
    got = core.read_namespaced_pod("a", "default")
    assert got.metadata.annotations == {"ALIYUN_COM_GPU_MEM_IDX": "1"}
    assert got.metadata.labels == {"app": "x"}
    with pytest.raises(ApiException) as info:
        core.patch_namespaced_pod(
            "a",
            "default",
            [{"op": "test", "path": "/metadata/resourceVersion", "value": current.metadata.resource_version}],
        )
    assert info.value.status == 422


def test_pod_spec_is_immutable_except_images(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod("a", 2))
    with pytest.raises(ApiException) as info:
        core.patch_namespaced_pod("a", "default", {"spec": {"nodeName": "n1"}})
    assert info.value.status == 422
    assert "pod updates may not change fields" in info.value.body


def test_status_subresource(core: client.CoreV1Api) -> None:
    core.create_node(node("n1"))
    capacity = {"status": {"capacity": {GPU_MEM: "64", "aliyun.com/gpu-count": "4"}}}
    core.patch_node("n1", capacity)  # the main resource ignores status, as kube-apiserver does
    assert core.read_node("n1").status.capacity is None
    core.patch_node_status("n1", capacity)
    assert core.read_node("n1").status.capacity == {GPU_MEM: "64", "aliyun.com/gpu-count": "4"}
    core.patch_node_status("n1", {"metadata": {"annotations": {"gpushared.io/gpu-inventory": "{}"}}})
    assert core.read_node("n1").metadata.annotations == {"gpushared.io/gpu-inventory": "{}"}
    core.create_namespaced_pod("default", pod("p", 1))
    core.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"}})
    assert core.read_namespaced_pod("p", "default").status.phase == "Running"


def test_binding(core: client.CoreV1Api, api: FakeApiServer) -> None:
    created = core.create_namespaced_pod("default", pod("a", 2))
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {
            "name": "a",
            "uid": created.metadata.uid,
            "annotations": {"ALIYUN_COM_GPU_MEM_IDX": "0"},
        },
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    # kube-apiserver answers a binding with a Status, which the client cannot read as a V1Binding.
    response = core.create_namespaced_pod_binding("a", "default", binding, _preload_content=False)
    assert response.status == 201
    bound = core.read_namespaced_pod("a", "default")
    assert bound.spec.node_name == "n1"
    assert bound.metadata.annotations["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert [c.type for c in bound.status.conditions] == ["PodScheduled"]
    with pytest.raises(ApiException) as info:
        core.create_namespaced_pod_binding("a", "default", binding, _preload_content=False)
    assert info.value.status == 409
    assert "already assigned" in info.value.body
    core.create_namespaced_pod("default", pod("b", 2))
    wrong_uid = {**binding, "metadata": {"name": "b", "uid": "nope"}}
    with pytest.raises(ApiException) as info:
        core.create_namespaced_pod_binding("b", "default", wrong_uid, _preload_content=False)
    assert info.value.status == 409
    # The older collection endpoint names the pod in the body.
    legacy = {**binding, "metadata": {"name": "b"}, "target": {"kind": "Node", "name": "n2"}}
    core.create_namespaced_binding("default", legacy, _preload_content=False)
    assert api.get("pods", "b", "default")["spec"]["nodeName"] == "n2"  # type: ignore[index]


def test_events(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_pod("default", pod("a", 2))
    event = {
        "metadata": {"generateName": "a."},
        "involvedObject": {"kind": "Pod", "namespace": "default", "name": "a", "uid": created.metadata.uid},
        "reason": "GpuAllocationFailed",
        "message": "no GPU",
        "type": "Warning",
        "source": {"component": "gpushared"},
    }
    core.create_namespaced_event("default", event)
    found = core.list_namespaced_event("default", field_selector="involvedObject.name=a,reason=GpuAllocationFailed")
    assert [(e.reason, e.message, e.metadata.name.startswith("a.")) for e in found.items] == [
        ("GpuAllocationFailed", "no GPU", True)
    ]


def watch_events(stream: Any, count: int) -> list[tuple[str, str]]:
    seen = []
    for event in stream:
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == count:
            break
    return seen


def test_watch_with_selector_sees_objects_enter_and_leave(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod("early", 1, node="n1"))
    w = watch.Watch()
    stream = w.stream(core.list_pod_for_all_namespaces, field_selector="spec.nodeName=n1", timeout_seconds=5)

    def later() -> None:
        time.sleep(0.2)
        core.create_namespaced_pod("default", pod("a", 1))
        core.create_namespaced_binding(
            "default",
            {"metadata": {"name": "a"}, "target": {"kind": "Node", "name": "n1"}},
            _preload_content=False,
        )
        core.patch_namespaced_pod_status("a", "default", {"status": {"phase": "Running"}})
        core.delete_namespaced_pod("a", "default", grace_period_seconds=0)

    threading.Thread(target=later).start()
    assert watch_events(stream, 4) == [
        ("ADDED", "early"),
        ("ADDED", "a"),
        ("MODIFIED", "a"),
        ("DELETED", "a"),
    ]
    w.stop()


def test_watch_resumes_from_a_resource_version(core: client.CoreV1Api) -> None:
    listed = core.list_node()
    core.create_node(node("n1"))
    core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})
    w = watch.Watch()
    events = watch_events(
        w.stream(core.list_node, resource_version=listed.metadata.resource_version, timeout_seconds=2), 2
    )
    assert events == [("ADDED", "n1"), ("MODIFIED", "n1")]


def test_watch_from_a_compacted_version_is_410_gone(core: client.CoreV1Api, api: FakeApiServer) -> None:
    old = core.list_node().metadata.resource_version
    core.create_node(node("n1"))
    api.compact()
    with pytest.raises(ApiException) as info:
        list(watch.Watch().stream(core.list_node, resource_version=old, timeout_seconds=2))
    assert info.value.status == 410
    # What an informer does next: relist, then watch from the list's version.
    relisted = core.list_node()
    assert [n.metadata.name for n in relisted.items] == ["n1"]
    core.create_node(node("n2"))
    assert watch_events(
        watch.Watch().stream(core.list_node, resource_version=relisted.metadata.resource_version, timeout_seconds=2),
        1,
    ) == [("ADDED", "n2")]


def test_open_watches_can_be_expired_and_cut(core: client.CoreV1Api, api: FakeApiServer) -> None:
    results: dict[str, Any] = {}

    def consume(tag: str) -> None:
        try:
            for _ in watch.Watch().stream(
                core.list_node,
                resource_version=core.list_node().metadata.resource_version,
                timeout_seconds=10,
            ):
                pass
            results[tag] = "ended"
        except ApiException as exc:
            results[tag] = exc.status
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            results[tag] = type(exc).__name__

    first = threading.Thread(target=consume, args=("expired",))
    first.start()
    _wait_for(lambda: api.open_watches == 1)
    api.expire_watches()
    first.join(5)
    assert results["expired"] == 410
    # The server forgets a watch only after its last event went out; the next one must not be mistaken for it.
    _wait_for(lambda: api.open_watches == 0)
    second = threading.Thread(target=consume, args=("cut",))
    second.start()
    _wait_for(lambda: api.open_watches == 1)
    api.cut_watches()
    second.join(5)
    assert results["cut"] not in (None, 410)
    assert api.open_watches == 0


def test_injected_faults(core: client.CoreV1Api, api: FakeApiServer) -> None:
    core.create_node(node("n1"))
    api.inject(Fault(method="GET", path=r"/nodes/n1$", status=503, times=2))
    for _ in range(2):
        with pytest.raises(ApiException) as info:
            core.read_node("n1")
        assert info.value.status == 503
    assert core.read_node("n1").metadata.name == "n1"
    conflict = api.inject(Fault(method="PATCH", path=r"/pods/", status=409))
    core.create_namespaced_pod("default", pod("a", 1))
    with pytest.raises(ApiException) as info:
        core.patch_namespaced_pod("a", "default", {"metadata": {"labels": {"x": "y"}}})
    assert (info.value.status, conflict.hits) == (409, 1)
    api.inject(Fault(method="GET", path=r"/nodes$", delay=0.3))
    started = time.monotonic()
    core.list_node()
    assert time.monotonic() - started >= 0.3
    # urllib3 retries a connection cut before the response; one cut is absorbed, a lasting one is not.
    once = api.inject(Fault(method="GET", path=r"/nodes$", cut=True))
    assert core.list_node().items
    assert once.hits == 1
    lasting = api.inject(Fault(method="GET", path=r"/nodes$", cut=True, times=None))
    with pytest.raises(urllib3.exceptions.HTTPError):
        core.list_node(_request_timeout=2)
    assert lasting.hits > 1
    api.faults.remove(lasting)
    api.inject(Fault(path=r"/nodes$", watch=True, status=410))
    with pytest.raises(ApiException) as info:
        list(watch.Watch().stream(core.list_node, timeout_seconds=1))
    assert info.value.status == 410


def test_graceful_deletion_of_a_bound_pod(core: client.CoreV1Api, api: FakeApiServer) -> None:
    core.create_namespaced_pod("default", pod("a", 1, node="n1"))
    core.create_namespaced_pod("default", pod("unbound", 1))
    core.delete_namespaced_pod("unbound", "default")
    assert api.get("pods", "unbound", "default") is None
    core.delete_namespaced_pod("a", "default")
    terminating = core.read_namespaced_pod("a", "default")
    assert terminating.metadata.deletion_timestamp is not None
    assert terminating.metadata.deletion_grace_period_seconds == 30
    core.delete_namespaced_pod("a", "default", grace_period_seconds=0)  # what the kubelet does when it stopped
    assert api.get("pods", "a", "default") is None


def test_requests_are_logged_for_assertions(core: client.CoreV1Api, api: FakeApiServer) -> None:
    core.list_namespaced_pod("default", field_selector="spec.nodeName=n1")
    assert api.requests[-1].path == "/api/v1/namespaces/default/pods"
    assert api.requests[-1].query["fieldSelector"] == "spec.nodeName=n1"


def _wait_for(condition: Any, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
