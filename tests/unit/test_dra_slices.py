"""What a DRA-mode node publishes (core.dra.slices): devices, attributes, capacities the API server accepts, and a
pool generation that changes exactly when the devices do."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit, dra
from gpushared.core.dra.capacity import model_device
from gpushared.core.dra.slices import (
    format_bytes,
    nvlink_domains,
    pool_generation,
    slice_body,
    slice_devices,
    slice_name,
)

GI = 2**30


def gpu(index: int, *, mib: int = 15360, healthy: bool = True, numa: int | None = None) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index}aaa-bbb", "Tesla T4", mib // 1024, mib, healthy=healthy, numa=numa)


def test_one_device_per_healthy_gpu_named_by_uuid() -> None:
    inventory = GpuInventory(unit=MemoryUnit.GIB, gpus=(gpu(0, numa=1), gpu(1, healthy=False), gpu(2)))
    devices = slice_devices(inventory)
    assert [d["name"] for d in devices] == ["gpu-0aaa-bbb", "gpu-2aaa-bbb"]
    first = devices[0]
    assert first["allowMultipleAllocations"] is True
    assert first["attributes"] == {
        dra.ATTRIBUTE_UUID: {"string": "GPU-0aaa-bbb"},
        dra.ATTRIBUTE_INDEX: {"int": 0},
        dra.ATTRIBUTE_PRODUCT: {"string": "Tesla T4"},
        dra.ATTRIBUTE_MPS: {"bool": False},
        dra.ATTRIBUTE_NUMA: {"int": 1},
    }
    assert dra.ATTRIBUTE_NUMA not in devices[1]["attributes"]


def test_memory_is_the_gpu_in_whole_units_consumed_in_units() -> None:
    for unit, step in ((MemoryUnit.GIB, "1Gi"), (MemoryUnit.MIB, "1Mi")):
        inventory = GpuInventory(unit=unit, gpus=(GpuInfo(0, "GPU-x", "m", unit.from_mib(15109), 15109),))
        memory = slice_devices(inventory)[0]["capacity"][dra.CAPACITY_MEMORY]
        expected = format_bytes(unit.to_bytes(unit.from_mib(15109)))
        assert memory == {
            "value": expected,
            "requestPolicy": {"default": expected, "validRange": {"min": step, "step": step}},
        }


def test_nvlink_domains_join_gpus_linked_directly_or_through_others() -> None:
    # 0-1 NVLink, 1-2 NVLink, 3 on PCIe only: {0, 1, 2} one domain, 3 none.
    words = ("NV2", "SYS", "SYS", "NV1", "SYS", "PHB")
    inventory = GpuInventory(unit=MemoryUnit.GIB, gpus=tuple(gpu(i) for i in range(4)), links=words)
    domains = nvlink_domains(inventory)
    assert set(domains) == {0, 1, 2}
    assert len(set(domains.values())) == 1
    devices = {d["name"]: d for d in slice_devices(inventory)}
    assert dra.ATTRIBUTE_NVLINK_DOMAIN not in devices["gpu-3aaa-bbb"]["attributes"]


def test_the_same_devices_keep_the_generation_a_change_takes_the_next() -> None:
    inventory = GpuInventory(unit=MemoryUnit.GIB, gpus=(gpu(0), gpu(1)))
    devices = slice_devices(inventory)
    existing = [slice_body(node="n", node_uid="u", generation=7, devices=devices)]
    assert pool_generation(existing, devices) == (7, False)
    assert pool_generation(existing, devices[:1]) == (8, True)
    assert pool_generation([], devices) == (1, True)
    two = [*existing, {**existing[0], "metadata": {"name": "old"}}]
    assert pool_generation(two, devices) == (8, True), "a pool of two slices is made one again"


def test_the_slice_is_owned_by_its_node_and_named_within_limits() -> None:
    body = slice_body(node="n1", node_uid="uid-1", generation=1, devices=[])
    assert body["metadata"]["ownerReferences"][0] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "n1",
        "uid": "uid-1",
        "controller": True,
    }
    assert body["spec"]["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 1}
    assert body["spec"]["nodeName"] == "n1"
    long = slice_name("n" * 253)
    assert len(long) <= 253
    assert long != slice_name("n" * 252 + "m")


@st.composite
def inventories(draw: st.DrawFn) -> GpuInventory:
    unit = draw(st.sampled_from(MemoryUnit))
    gpus = tuple(
        GpuInfo(i, f"GPU-{i}", "m", unit.from_mib(mib := draw(st.integers(1024, 196608))), mib)
        for i in range(draw(st.integers(1, 8)))
    )
    return GpuInventory(unit=unit, gpus=gpus)


@settings(max_examples=200, deadline=None)
@given(inventory=inventories())
def test_every_published_capacity_passes_the_api_servers_validation(inventory: GpuInventory) -> None:
    """kube-apiserver's rules for a requestPolicy (resource.k8s.io/v1 validation): min <= default <= value,
    default and max multiples of step (from min), min + step <= value; a capacity the scheduler reads back
    exactly; names that are DNS labels; at most 32 attributes and capacities."""
    for body in slice_devices(inventory):
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", body["name"]) and len(body["name"]) <= 63
        assert len(body["attributes"]) + len(body["capacity"]) <= 32
        device = model_device(body)
        for capacity in device.capacities.values():
            policy = capacity.policy
            assert policy is not None and policy.min is not None and policy.default is not None
            assert policy.min <= policy.default <= capacity.value
            assert policy.max is None or policy.max <= capacity.value
            if policy.step is not None:
                assert (policy.default - policy.min) % policy.step == 0
                assert policy.max is None or (policy.max - policy.min) % policy.step == 0
                assert policy.min + policy.step <= capacity.value
            else:
                assert policy.default == capacity.value == policy.min, "without a step, any request is the whole"
        assert all(_quantity_text(v["value"]) for v in body["capacity"].values())


def _quantity_text(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9]+(Ki|Mi|Gi|Ti)?", value) is not None
