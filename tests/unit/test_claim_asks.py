"""What a pending claim asks, as the claim allocator reads it (``core.placement.claims``): each row a claim
as the API server sends it, and the ask, the hand-over to kube-scheduler and its reason, or nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushared.contract import dra
from gpushared.core.placement.claims.asks import ClaimAsk, DeviceAsk, Handover, read_pending

GI = 2**30


def claim(*requests: dict[str, Any], **devices: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "team", "name": "c", "uid": "u-1", "resourceVersion": "41"},
        "spec": {"devices": {"requests": list(requests), **devices}},
    }


def ours(
    name: str = "gpu", *, memory: str | None = "4Gi", compute: int | None = None, **exactly: Any
) -> dict[str, Any]:
    wanted: dict[str, Any] = {}
    if memory is not None:
        wanted["memory"] = memory
    if compute is not None:
        wanted["compute"] = compute
    body: dict[str, Any] = {"deviceClassName": dra.DEVICE_CLASS, **exactly}
    if wanted:
        body["capacity"] = {"requests": wanted}
    return {"name": name, "exactly": body}


def theirs(name: str = "nic") -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": "nic.example.com"}}


def ask(*requests: DeviceAsk, linked: bool = False, mps: bool = False) -> ClaimAsk:
    return ClaimAsk(
        namespace="team", name="c", uid="u-1", resource_version="41", requests=requests, linked=linked, mps=mps
    )


MPS_CONFIG = [
    {
        "requests": ["gpu"],
        "opaque": {
            "driver": dra.DRIVER,
            "parameters": {"apiVersion": dra.CONFIG_API_VERSION, "kind": dra.CONFIG_KIND, "mps": True},
        },
    }
]
LINKED = [{"matchAttribute": f"{dra.DRIVER}/{dra.ATTRIBUTE_NVLINK_DOMAIN}"}]

CASES: list[tuple[str, dict[str, Any], ClaimAsk | Handover | None]] = [
    ("one GPU's 4 GiB", claim(ours()), ask(DeviceAsk("gpu", 1, 4 * GI, 0))),
    ("memory and a compute share", claim(ours(compute=25)), ask(DeviceAsk("gpu", 1, 4 * GI, 25))),
    (
        "two whole GPUs, linked",
        claim(ours(memory=None, count=2), constraints=LINKED),
        ask(DeviceAsk("gpu", 2, None, 0), linked=True),
    ),
    ("an MPS claim", claim(ours(), config=MPS_CONFIG), ask(DeviceAsk("gpu", 1, 4 * GI, 0), mps=True)),
    (
        "two requests",
        claim(ours("a"), ours("b", memory="8Gi", count=2)),
        ask(DeviceAsk("a", 1, 4 * GI, 0), DeviceAsk("b", 2, 8 * GI, 0)),
    ),
    ("not ours", claim(theirs()), None),
    ("allocated already", {**claim(ours()), "status": {"allocation": {"devices": {"results": []}}}}, None),
    (
        "another driver's devices too",
        claim(ours(), theirs()),
        Handover("also requests devices of class nic.example.com: one allocator for the whole claim"),
    ),
    ("all devices", claim(ours(allocationMode="All")), Handover("request gpu asks for allocationMode All")),
    (
        "CEL selectors",
        claim(ours(selectors=[{"cel": {"expression": "true"}}])),
        Handover("request gpu has CEL selectors, which only kube-scheduler evaluates"),
    ),
    ("admin access", claim(ours(adminAccess=True)), Handover("request gpu asks for admin access")),
    (
        "a prioritized list of ours",
        claim({"name": "p", "firstAvailable": [{"name": "big", "deviceClassName": dra.DEVICE_CLASS}]}),
        Handover("request p is a prioritized list (firstAvailable), which kube-scheduler ranks"),
    ),
    (
        "another constraint",
        claim(ours(), constraints=[{"matchAttribute": "gpu.gpushared.io/productName"}]),
        Handover("has a constraint other than matchAttribute gpu.gpushared.io/nvlinkDomain"),
    ),
    (
        "a capacity no GPU has",
        claim(
            {
                "name": "gpu",
                "exactly": {"deviceClassName": dra.DEVICE_CLASS, "capacity": {"requests": {"power": "300"}}},
            }
        ),
        Handover("request gpu asks for capacity power, which no GPU of this driver has"),
    ),
    ("too many devices", claim(ours(count=20), ours("b", count=13)), Handover("asks for more than 32 devices")),
    (
        "a count out of range",
        claim(ours(count=0)),
        Handover("unreadable: spec.devices.requests[0].exactly.count: expected 1 to 32 (got 0)"),
    ),
    (
        "no memory at all",
        claim(ours(memory="0")),
        Handover(
            "unreadable: spec.devices.requests[0].exactly.capacity.requests.memory: must be more than 0 (got '0')"
        ),
    ),
    (
        "a compute share past the GPU",
        claim(ours(compute=150)),
        Handover(
            "unreadable: spec.devices.requests[0].exactly.capacity.requests.compute: "
            "expected a percentage of a GPU, 0-100 (got 150)"
        ),
    ),
]


@pytest.mark.parametrize(("body", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_read_pending(body: dict[str, Any], expected: ClaimAsk | Handover | None) -> None:
    assert read_pending(body) == expected


def test_the_ask_counts_its_devices() -> None:
    found = read_pending(claim(ours("a"), ours("b", count=3)))
    assert isinstance(found, ClaimAsk) and found.devices == 4


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
paths = st.sampled_from(
    [
        ("spec",),
        ("spec", "devices"),
        ("spec", "devices", "requests"),
        ("spec", "devices", "requests", 0),
        ("spec", "devices", "requests", 0, "exactly"),
        ("spec", "devices", "requests", 0, "exactly", "count"),
        ("spec", "devices", "requests", 0, "exactly", "capacity"),
        ("spec", "devices", "requests", 0, "exactly", "capacity", "requests", "memory"),
        ("spec", "devices", "constraints"),
        ("spec", "devices", "config"),
        ("metadata",),
        ("metadata", "uid"),
        ("status",),
    ]
)


@given(path=paths, value=json_values)
def test_any_value_anywhere_is_an_ask_a_hand_over_or_nothing_never_an_exception(
    path: tuple[str | int, ...], value: Any
) -> None:
    body = copy.deepcopy(claim(ours(), constraints=LINKED, config=MPS_CONFIG))
    target: Any = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    found = read_pending(body)
    assert found is None or isinstance(found, ClaimAsk | Handover)
    if isinstance(found, ClaimAsk):
        assert all(1 <= r.count <= 32 and (r.memory is None or r.memory > 0) for r in found.requests)
