"""Allocate's rows that need I/O: the API server and the kubelet's PodResources unreachable, through
``daemon.candidates`` with fakes that fail (the table of every other refusal is test_allocate.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpushared.contract import DEFAULT_RESOURCES, MemoryUnit
from gpushared.core.node.handshake import Unidentified
from gpushared.daemon.candidates import Candidates
from gpushared.kube.api import KubeError, NotFound
from gpushared.kubelet.deviceplugin.server import AllocationRefused
from tests.allocating import placed


class _Pods:
    """The node's pod watch, as far as Candidates reads it."""

    def __init__(self, *bodies: dict[str, Any]) -> None:
        self.bodies = list(bodies)

    def pods(self) -> list[dict[str, Any]]:
        return self.bodies

    def find(self, namespace: str, name: str) -> dict[str, Any] | None:
        return next((b for b in self.bodies if b["metadata"]["name"] == name), None)

    def remember(self, body: dict[str, Any]) -> None:
        self.bodies.append(body)


class _Api:
    def __init__(self, get_pod: Callable[..., dict[str, Any]]) -> None:
        self.get_pod = get_pod

    def without_retries(self) -> _Api:
        return self


def _unreachable(namespace: str, name: str, *, timeout: float) -> dict[str, Any]:
    raise KubeError(f"get pod {namespace}/{name}: API server unreachable (timed out)")


def _gone(namespace: str, name: str, *, timeout: float) -> dict[str, Any]:
    raise NotFound(f"get pod {namespace}/{name}: 404 not found", status=404)


def candidates_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, listing: Any, api: Any, pods: _Pods
) -> Candidates:
    from gpushared.daemon import candidates as module

    monkeypatch.setattr(module, "list_pod_devices", listing)
    slept: list[float] = []
    return Candidates(
        node="n1",
        unit=MemoryUnit.GIB,
        resources=DEFAULT_RESOURCES,
        api=api,
        pods=pods,
        pod_resources_socket=tmp_path,
        sleep=slept.append,  # the retries' pauses: none of the wall clock
    )


def _listing(*names: str) -> Callable[..., list[Any]]:
    from gpushared.kubelet.podresources.client import PodDevices

    return lambda socket, *, resource: [PodDevices("default", name, {"c0": []}) for name in names]


def _no_kubelet(socket: Path, *, resource: str) -> list[Any]:
    from gpushared.kubelet.podresources.client import PodResourcesUnavailable

    raise PodResourcesUnavailable("StatusCode.UNAVAILABLE failed to connect")


def test_a_pod_the_watch_lacks_and_the_api_server_cannot_give_is_unavailable_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = candidates_with(tmp_path, monkeypatch, listing=_listing("new"), api=_Api(_unreachable), pods=_Pods())
    with pytest.raises(AllocationRefused, match="cannot read pod default/new to find its GPU") as info:
        found.identify(4, served=lambda uid: (), deadline=time.monotonic() + 2)
    assert info.value.retryable  # UNAVAILABLE: the kubelet tries the pod again


def test_a_pod_deleted_meanwhile_is_no_candidate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = candidates_with(tmp_path, monkeypatch, listing=_listing("gone"), api=_Api(_gone), pods=_Pods())
    with pytest.raises(Unidentified, match="no pod on node n1 is waiting for 4 GiB"):
        found.identify(4, served=lambda uid: (), deadline=time.monotonic() + 2)


def test_without_pod_resources_the_watch_alone_names_the_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = placed("w", 4, gpus=(1,))
    found = candidates_with(tmp_path, monkeypatch, listing=_no_kubelet, api=None, pods=_Pods(waiting))
    decision = found.identify(4, served=lambda uid: (), deadline=0.0)
    assert decision.chosen.key == "default/w"
    assert decision.chosen.next is not None and decision.chosen.next.indices == [1]
