"""The scheduler's consumable-capacity arithmetic (core.dra.capacity), and what the driver publishes checked
through it: for every sequence of claims, the slices never let a GPU be allocated past what it holds, and
the driver prepares every allocation the scheduler could make (tests of issue #44)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit, dra
from gpushared.core.dra.allocated import ClaimRef
from gpushared.core.dra.capacity import Capacity, ModelDevice, RequestPolicy, consumed, fits, model_device
from gpushared.core.dra.prepare import DraNode, PreparedClaim, PrepareRefusal, decide
from gpushared.core.dra.slices import format_bytes, slice_devices
from gpushared.core.node.exposure import ExposurePolicy

GI = 2**30
#: the GPUs named by variable only: these tests are about amounts, not device files
ENV_ONLY = ExposurePolicy(device_nodes=False)
EXAMPLES = 300

RANGED = Capacity(16 * GI, RequestPolicy(default=16 * GI, min=GI, step=GI))
VALUES = Capacity(16 * GI, RequestPolicy(default=4 * GI, valid_values=(4 * GI, 8 * GI, 16 * GI)))
BOUNDED = Capacity(100, RequestPolicy(default=0, min=0, max=60, step=5))


@pytest.mark.parametrize(
    ("requested", "capacity", "expected"),
    [
        pytest.param(None, Capacity(16 * GI), 16 * GI, id="no policy, no request: the whole capacity"),
        pytest.param(3 * GI + 1, Capacity(16 * GI), 3 * GI + 1, id="no policy: the request as it is"),
        pytest.param(None, RANGED, 16 * GI, id="range: no request takes the default"),
        pytest.param(4 * GI, RANGED, 4 * GI, id="range: on a step"),
        pytest.param(4 * GI + 1, RANGED, 5 * GI, id="range: between steps rounds up"),
        pytest.param(1, RANGED, GI, id="range: below min rounds up to min"),
        pytest.param(17 * GI, RANGED, 17 * GI, id="range without max: the capacity check refuses, not the policy"),
        pytest.param(61, BOUNDED, None, id="range: above max violates"),
        pytest.param(
            56, Capacity(100, RequestPolicy(min=0, max=58, step=5)), None, id="range: rounded past max violates"
        ),
        pytest.param(51, BOUNDED, 55, id="range: rounded within max"),
        pytest.param(None, BOUNDED, 0, id="range: default zero"),
        pytest.param(5 * GI, VALUES, 8 * GI, id="values: the smallest at or above"),
        pytest.param(None, VALUES, 4 * GI, id="values: default"),
        pytest.param(17 * GI, VALUES, None, id="values: above them all violates"),
    ],
)
def test_consumed(requested: int | None, capacity: Capacity, expected: int | None) -> None:
    assert consumed(requested, capacity) == expected


GPU = ModelDevice(
    "gpu", {"memory": RANGED, "compute": Capacity(100, RequestPolicy(default=0, min=0, max=100, step=1))}, shared=True
)


@pytest.mark.parametrize(
    ("used", "requests", "expected"),
    [
        pytest.param({}, {"memory": 6 * GI}, {"memory": 6 * GI, "compute": 0}, id="fits an empty GPU"),
        pytest.param({"memory": 12 * GI}, {"memory": 4 * GI}, {"memory": 4 * GI, "compute": 0}, id="fills it exactly"),
        pytest.param({"memory": 12 * GI}, {"memory": 4 * GI + 1}, None, id="rounded up past capacity"),
        pytest.param({"memory": GI}, {}, None, id="no request takes the whole GPU: not beside another"),
        pytest.param({"compute": 80}, {"memory": GI, "compute": 30}, None, id="compute past 100"),
        pytest.param({}, {"memory": GI, "cores": 1}, None, id="a capacity the device lacks"),
    ],
)
def test_fits(used: dict[str, int], requests: dict[str, int], expected: dict[str, int] | None) -> None:
    assert fits(GPU, used, requests) == expected


def test_a_device_not_shared_takes_one_allocation() -> None:
    whole = ModelDevice("gpu", {"memory": Capacity(16 * GI)}, shared=False)
    assert fits(whole, {}, {}) == {"memory": 16 * GI}
    assert fits(whole, {"memory": 16 * GI}, {}) is None


def test_the_published_device_reads_back_as_the_scheduler_reads_it() -> None:
    inventory = GpuInventory(unit=MemoryUnit.GIB, gpus=(GpuInfo(0, "GPU-a", "T4", 15, 15360),))
    device = model_device(slice_devices(inventory)[0])
    assert device.shared
    assert device.capacities[dra.CAPACITY_MEMORY] == Capacity(15 * GI, RequestPolicy(default=15 * GI, min=GI, step=GI))
    assert device.capacities[dra.CAPACITY_COMPUTE] == Capacity(100, RequestPolicy(default=0, min=0, max=100, step=1))


# --- every sequence of claims ---------------------------------------------------------------------------------


@st.composite
def inventories(draw: st.DrawFn) -> GpuInventory:
    unit = draw(st.sampled_from(MemoryUnit))
    gpus = []
    for i in range(draw(st.integers(1, 4))):
        mib = draw(st.integers(1024, 81920))  # a GPU's MiB need not be whole GiB
        gpus.append(
            GpuInfo(i, f"GPU-{i:04d}", "m", unit.from_mib(mib), mib, healthy=draw(st.booleans() | st.just(True)))
        )
    return GpuInventory(unit=unit, gpus=tuple(gpus))


claims = st.lists(
    st.tuples(
        st.none() | st.integers(1, 40 * GI),  # memory, in bytes, any
        st.none() | st.integers(0, 100),  # compute percent
        st.integers(0, 3),  # which device the scheduler tries first
    ),
    max_size=24,
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(inventory=inventories(), sequence=claims)
def test_no_sequence_of_claims_puts_a_gpu_past_what_it_holds(
    inventory: GpuInventory, sequence: list[tuple[int | None, int | None, int]]
) -> None:
    published = slice_devices(inventory)
    devices = [model_device(body) for body in published]
    assert [d.name for d in devices] == [dra.device_name(g.uuid) for g in inventory.gpus if g.healthy and g.memory]
    used: dict[str, dict[str, int]] = {d.name: {} for d in devices}
    node = DraNode(name="n", inventory=inventory, exposure=ENV_ONLY)
    prepared: list[PreparedClaim] = []
    for number, (memory, compute, first) in enumerate(sequence):
        requests = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
        order = devices[first % len(devices) :] + devices[: first % len(devices)] if devices else []
        for device in order:
            amounts = fits(device, used[device.name], requests)
            if amounts is None:
                continue
            for name, amount in amounts.items():
                used[device.name][name] = used[device.name].get(name, 0) + amount
            assert amounts["memory"] >= (memory or 0)
            assert amounts["memory"] % inventory.unit.to_bytes(1) == 0
            # The driver prepares what the scheduler allocated, and counts it the same.
            ref = ClaimRef("ns", f"c{number}", f"uid-{number}")
            outcome = decide(ref, _claim(ref, device.name, amounts), _with(node, prepared))
            assert not isinstance(outcome, PrepareRefusal), outcome
            prepared.append(outcome)
            break
    for gpu in inventory.gpus:
        name = dra.device_name(gpu.uuid)
        if name not in used:
            continue
        assert used[name].get("memory", 0) <= inventory.unit.to_bytes(gpu.memory) <= gpu.memory_mib * 2**20
        assert used[name].get("compute", 0) <= 100
        held = sum(d.memory for c in prepared for d in c.devices if d.uuid == gpu.uuid)
        assert inventory.unit.to_bytes(held) == used[name].get("memory", 0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(inventory=inventories(), extra=st.integers(1, 8 * GI))
def test_the_driver_refuses_what_a_lying_scheduler_puts_past_capacity(inventory: GpuInventory, extra: int) -> None:
    gpu = next((g for g in inventory.gpus if g.healthy and g.memory), None)
    if gpu is None:
        return
    name = dra.device_name(gpu.uuid)
    node = DraNode(name="n", inventory=inventory, exposure=ENV_ONLY)
    full = decide(
        ClaimRef("ns", "a", "a"),
        _claim(ClaimRef("ns", "a", "a"), name, {"memory": inventory.unit.to_bytes(gpu.memory)}),
        node,
    )
    assert isinstance(full, PreparedClaim)
    more = decide(
        ClaimRef("ns", "b", "b"), _claim(ClaimRef("ns", "b", "b"), name, {"memory": extra}), _with(node, [full])
    )
    assert isinstance(more, PrepareRefusal)
    # past the GPU, or (a lie no scheduler tells) not whole units of the slice's request policy
    assert "does not fit" in more.message or "whole units" in more.message


def _with(node: DraNode, prepared: list[PreparedClaim]) -> DraNode:
    return DraNode(name=node.name, inventory=node.inventory, prepared=list(prepared), exposure=ENV_ONLY)


def _claim(ref: ClaimRef, device: str, amounts: dict[str, int]) -> dict[str, Any]:
    consumed = {"memory": format_bytes(amounts["memory"])}
    if "compute" in amounts:
        consumed["compute"] = str(amounts["compute"])
    return {
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": dra.DRIVER,
                            "pool": "n",
                            "device": device,
                            "consumedCapacity": consumed,
                        }
                    ]
                }
            }
        },
    }
