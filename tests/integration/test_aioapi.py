"""The extender's async bind client against the fake API server: what it sends, and its errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.api import KubeError
from gpushared.kube.credentials import Credentials
from tests.builders import pod
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.harness import free_port

T = TypeVar("T")


def run(api: AsyncApi, call: Callable[[AsyncApi], Awaitable[T]]) -> T:
    async def once() -> T:
        try:
            return await call(api)
        finally:
            await api.close()

    return asyncio.run(once())


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as api:
        api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        yield api


def configured(server: FakeApiServer, *, token: str = "secret") -> AsyncApi:
    return AsyncApi(server.credentials(token=token))


def test_bind_creates_the_binding_with_the_annotations_and_the_token(server: FakeApiServer) -> None:
    created = server.create(pod("p", 4))
    uid = created["metadata"]["uid"]
    run(configured(server), lambda api: api.bind_pod("default", "p", uid=uid, node="n1", annotations={"a/b": "1"}))
    bound = server.get("pods", "p", "default")
    assert bound is not None
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"]["a/b"] == "1"
    assert int(bound["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    (binding,) = [r for r in server.requests if r.path.endswith("/binding")]
    assert binding.authorization == "Bearer secret"


def test_get_pod_and_the_api_servers_refusals(server: FakeApiServer) -> None:
    uid = server.create(pod("p", 4))["metadata"]["uid"]
    assert run(configured(server), lambda api: api.get_pod("default", "p"))["metadata"]["uid"] == uid
    with pytest.raises(KubeError) as missing:
        run(configured(server), lambda api: api.get_pod("default", "nope"))
    assert missing.value.status == 404
    assert str(missing.value) == 'get pod default/nope: 404 pods "nope" not found'
    with pytest.raises(KubeError) as stale:
        run(configured(server), lambda api: api.bind_pod("default", "p", uid="other", node="n1", annotations={}))
    assert stale.value.status == 409
    assert "UID in precondition: other" in str(stale.value)
    server.inject(Fault(method="POST", path=r"/binding$", status=500, message="etcd hiccup"))
    with pytest.raises(KubeError, match=r"^bind pod default/p to n1: 500 etcd hiccup$"):
        run(configured(server), lambda api: api.bind_pod("default", "p", uid=uid, node="n1", annotations={}))


def test_an_unreachable_api_server_is_an_error_without_status() -> None:
    credentials = Credentials(server=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(KubeError, match=r"^get pod default/p: API server unreachable \(") as unreachable:
        run(AsyncApi(credentials), lambda api: api.get_pod("default", "p"))
    assert unreachable.value.status is None


def test_only_http_proxies_are_taken() -> None:
    with pytest.raises(KubeError, match="through http:// proxies only"):
        AsyncApi(Credentials(server="https://10.0.0.1:6443", proxy="socks5://proxy:1080"))
    assert AsyncApi(Credentials(server="https://10.0.0.1:6443")).proxy is None
