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


# --- what the claim allocator (issue #54) leans on ------------------------------------------------------

GATE = "gpushared.io/claim-allocator"


def gated_pod(name: str = "p") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"schedulingGates": [{"name": GATE}], "containers": [{"name": "c", "image": "busybox"}]},
    }


def test_a_scheduling_gate_is_only_ever_removed_and_a_gated_pod_is_not_bound() -> None:
    with FakeApiServer() as api:
        rest = api.rest()
        path = "/api/v1/namespaces/default/pods"
        pod = rest.request("create", "POST", path, body=gated_pod())
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"}, "target": {"name": "n1"}}
        with pytest.raises(KubeError, match=r"500.*non-empty .spec.schedulingGates"):
            rest.request("bind", "POST", f"{path}/p/binding", body=binding)
        added = {**pod, "spec": {**pod["spec"], "schedulingGates": [{"name": GATE}, {"name": "x.example.com/hold"}]}}
        with pytest.raises(KubeError, match=r"422.*only deletion is allowed, but found new scheduling gate"):
            rest.request("add a gate", "PUT", f"{path}/p", body=added)
        ungated = {**pod, "spec": {**pod["spec"], "schedulingGates": []}}
        assert rest.request("remove the gate", "PUT", f"{path}/p", body=ungated)["spec"]["schedulingGates"] == []
        rest.request("bind", "POST", f"{path}/p/binding", body=binding)
        assert api.get("pods", "p", "default")["spec"]["nodeName"] == "n1"  # type: ignore[index]


def test_a_stale_claim_status_write_fails_unlike_a_second_binding_of_another_pod() -> None:
    """Two allocators that read the same claim: the second status write carries the resourceVersion both
    read, and is refused, so a claim is never allocated twice."""
    with FakeApiServer() as api:
        rest = api.rest()
        path = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "default"},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-mem.gpushared.io"}}]}
            },
        }
        read = rest.request("create", "POST", path, body=claim)

        def allocated(device: str) -> dict[str, Any]:
            result = {"request": "gpu", "driver": "gpu.gpushared.io", "pool": "n1", "device": device}
            return {**read, "status": {"allocation": {"devices": {"results": [result]}}}}

        first = rest.request("allocate", "PUT", f"{path}/c/status", body=allocated("gpu-a"))
        assert first["metadata"]["resourceVersion"] != read["metadata"]["resourceVersion"]
        with pytest.raises(KubeError, match=r"409.*has been modified"):
            rest.request("allocate again", "PUT", f"{path}/c/status", body=allocated("gpu-b"))
        stored = api.get("resourceclaims", "c", "default")
        assert stored["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-a"  # type: ignore[index]
