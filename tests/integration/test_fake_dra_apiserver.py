"""The fake API server's resource.k8s.io/v1: discovery, the ResourceSlice checks kube-apiserver makes, and
the field selectors a node's driver lists its slices with (what tests/integration/test_dra_daemon.py leans on)."""

from __future__ import annotations

from typing import Any

import pytest

from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.dra.slices import slice_body, slice_devices
from gpushared.kube.errors import KubeError
from gpushared.kube.resources import ResourceApi
from tests.fakes.apiserver import FakeApiServer


def body(node: str, *, gib: int = 16) -> dict[str, Any]:
    inventory = GpuInventory(unit=MemoryUnit.GIB, gpus=(GpuInfo(0, f"GPU-{node}", "T4", gib, gib * 1024),))
    return slice_body(node=node, node_uid=None, generation=1, devices=slice_devices(inventory))


def test_discovery_says_whether_dra_is_served() -> None:
    with FakeApiServer() as api:
        resources = ResourceApi(api.rest())
        assert resources.served()
        api.dra_served = False
        assert not resources.served()


def test_a_node_lists_its_own_slices() -> None:
    with FakeApiServer() as api:
        resources = ResourceApi(api.rest())
        for node in ("a", "b"):
            resources.create_slice(body(node))
        assert [s["spec"]["nodeName"] for s in resources.list_slices(node="a", driver="gpu.gpushared.io")] == ["a"]
        assert resources.list_slices(node="a", driver="other.example.com") == []


def test_an_invalid_slice_is_refused_as_kube_apiserver_refuses_it() -> None:
    with FakeApiServer() as api:
        resources = ResourceApi(api.rest())
        bad = body("a")
        bad["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] = "16Gi"
        with pytest.raises(KubeError, match=r"422.*step"):
            resources.create_slice(bad)
        bad = body("a")
        bad["spec"]["devices"][0]["name"] = "GPU_0"
        with pytest.raises(KubeError, match=r"422.*RFC 1123"):
            resources.create_slice(bad)
        resources.create_slice(body("a", gib=1))
