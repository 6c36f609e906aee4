"""What deploy/dra/ ships: the DeviceClass and example claims agree with what the driver publishes, the
driver's RBAC, and the admission policy that keeps each node to its own ResourceSlice (its CEL evaluated
here with cel-python, as tests/unit/test_admission_policies.py evaluates the others)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes

from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit, dra, parse_int
from gpushared.core.dra.capacity import fits, model_device
from gpushared.core.dra.slices import slice_devices
from gpushared.core.shared.quantity import parse_whole_quantity
from tests.unit.test_admission_policies import _evaluate

DRA = Path(__file__).parents[2] / "deploy" / "dra"
NODE_SA = "system:serviceaccount:kube-system:gpushared-node"


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def templates() -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d["spec"]["spec"]
        for path in sorted((DRA / "examples").glob("*.yaml"))
        for d in documents(path)
        if d["kind"] == "ResourceClaimTemplate"
    }


def test_the_device_class_selects_the_drivers_devices() -> None:
    (device_class,) = documents(DRA / "deviceclass.yaml")
    assert device_class["metadata"]["name"] == dra.DEVICE_CLASS
    assert device_class["apiVersion"] == f"{dra.API_GROUP}/{dra.API_VERSION}"
    (selector,) = device_class["spec"]["selectors"]
    assert selector["cel"]["expression"] == f"device.driver == '{dra.DRIVER}'"


def test_every_example_asks_what_a_published_gpu_can_give() -> None:
    inventory = GpuInventory(unit=MemoryUnit.GIB, gpus=(GpuInfo(0, "GPU-a", "T4", 15, 15360),))
    device = model_device(slice_devices(inventory)[0])
    found = templates()
    assert set(found) == {"gpu-6gi", "gpu-4gi-mps", "two-linked-gpus"}
    for name, spec in found.items():
        for request in spec["devices"]["requests"]:
            exactly = request["exactly"]
            assert exactly["deviceClassName"] == dra.DEVICE_CLASS, name
            wanted = {
                k: parse_whole_quantity(k, v) for k, v in (exactly.get("capacity") or {}).get("requests", {}).items()
            }
            assert fits(device, {}, wanted) is not None, name
        for config in spec["devices"].get("config", []):
            assert config["opaque"]["driver"] == dra.DRIVER
            dra.parse_gpu_config(config["opaque"]["parameters"])
    (constraint,) = found["two-linked-gpus"]["devices"]["constraints"]
    assert constraint["matchAttribute"] == f"{dra.DRIVER}/{dra.ATTRIBUTE_NVLINK_DOMAIN}"
    mps = dra.parse_gpu_config(found["gpu-4gi-mps"]["devices"]["config"][0]["opaque"]["parameters"])
    compute = parse_int(
        "compute", found["gpu-4gi-mps"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["compute"]
    )
    assert mps.mps and mps.compute_limit is not None and mps.compute_limit >= compute


def test_the_driver_may_write_slices_and_read_claims_and_nothing_else() -> None:
    role, binding = documents(DRA / "driver-rbac.yaml")
    assert role["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": ["get", "list", "watch", "create", "update", "delete"],
        },
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
    ]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpushared-node", "namespace": "kube-system"}]


def admit(operation: str, *, node: str, user: str, extra: dict[str, list[str]] | None = None) -> str | None:
    """None when the policy lets the request through (or does not apply), else the denial's message."""
    (policy, _binding) = documents(DRA / "admission-policy.yaml")
    spec = policy["spec"]
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "spec": {"nodeName": node}}
    user_info: dict[str, Any] = {"username": user}
    if extra is not None:
        user_info["extra"] = extra
    activation: dict[str, Any] = {
        "object": celpy.json_to_cel(None if operation == "DELETE" else body),
        "oldObject": celpy.json_to_cel(body if operation != "CREATE" else None),
        "request": celpy.json_to_cel({"operation": operation, "userInfo": user_info}),
    }
    for condition in spec["matchConditions"]:
        if not _evaluate(condition["expression"], activation):
            return None
    variables = celtypes.MapType({})
    activation["variables"] = variables
    for variable in spec["variables"]:
        variables[celtypes.StringType(variable["name"])] = _evaluate(variable["expression"], activation)
    for validation in spec["validations"]:
        if not _evaluate(validation["expression"], activation):
            return (
                str(_evaluate(validation["messageExpression"], activation))
                if "messageExpression" in validation
                else validation["message"]
            )
    return None


POD_TOKEN = {
    "authentication.kubernetes.io/node-name": ["n1"],
    "authentication.kubernetes.io/pod-name": ["gpushared-node-x"],
}


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
@pytest.mark.parametrize(
    ("user", "extra", "node", "allowed"),
    [
        pytest.param(f"{NODE_SA}-n1", None, "n1", True, id="per-node identity, its node"),
        pytest.param(f"{NODE_SA}-n1", None, "n2", False, id="per-node identity, another node"),
        pytest.param(NODE_SA, POD_TOKEN, "n1", True, id="the DaemonSet's token, its node"),
        pytest.param(NODE_SA, POD_TOKEN, "n2", False, id="the DaemonSet's token, another node"),
        pytest.param(NODE_SA, None, "n1", False, id="the shared identity outside a pod: no node"),
        pytest.param(
            "system:serviceaccount:kube-system:other-driver", None, "n2", True, id="not gpushared: not ours to judge"
        ),
    ],
)
def test_each_node_writes_only_its_own_slices(
    operation: str, user: str, extra: dict[str, list[str]] | None, node: str, allowed: bool
) -> None:
    message = admit(operation, node=node, user=user, extra=extra)
    assert (message is None) is allowed, message
    if not allowed:
        assert "its own node" in message or "tied to no node" in message  # type: ignore[operator]
