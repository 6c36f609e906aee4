"""What a pending DRA claim asks of gpushared's GPUs, as the claim allocator places it.

The claim allocator places the claims of gated pods with gpushared's policies instead of kube-scheduler's
first fit. It places only what it can place exactly as kube-scheduler would allocate it; anything else is
*handed over*: the pod's gate is removed and kube-scheduler allocates the claim by itself, first fit,
never past a GPU's capacity (and the driver checks again at prepare). Each hand-over says why, for the
pod's Event and the allocator's metrics, so that no pod is stranded silently.

A claim is read from ``spec.devices`` (``resource.k8s.io/v1``), bounded and typed once:

- a request of this driver's DeviceClass, ``exactly``, ``ExactCount`` of 1 to 32 devices, each consuming
  ``capacity.requests.memory`` (bytes) and ``capacity.requests.compute`` (percent), or asking for no
  memory, which takes each device whole (the capacity's ``default``);
- a ``matchAttribute`` constraint on ``gpu.gpushared.io/nvlinkDomain``: the devices joined by NVLink;
- this driver's opaque configuration (``GpuConfig``): whether its containers are MPS clients, since MPS and
  plain claims never share a GPU.

Handed over: requests of another class (the pod's other drivers' devices: one allocator for the whole
claim), ``allocationMode: All``, CEL ``selectors`` (only kube-scheduler evaluates CEL), ``firstAvailable``
(prioritized lists), ``adminAccess``, and any other constraint. Already allocated: left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpushared.contract import ContractError, dra
from gpushared.core.shared.quantity import parse_whole_quantity

#: ``resourceapi.AllocationResultsMaxSize``: the most devices one claim's allocation may list.
MAX_DEVICES = 32
#: The most requests, and constraints, a claim may have (``DeviceRequestsMaxSize``, ``DeviceConstraintsMaxSize``).
MAX_REQUESTS = 32
#: The constraint that asks for GPUs joined by NVLink.
NVLINK_ATTRIBUTE = f"{dra.DRIVER}/{dra.ATTRIBUTE_NVLINK_DOMAIN}"


@dataclass(frozen=True)
class DeviceAsk:
    """One request of a claim for this driver's GPUs."""

    request: str
    count: int
    #: bytes of GPU memory on each device; None: each device whole
    memory: int | None
    #: percent of each device's compute guaranteed
    compute: int


@dataclass(frozen=True)
class ClaimAsk:
    """What a pending claim asks, all of it this driver's, with what its status write must be guarded by."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    requests: tuple[DeviceAsk, ...]
    #: every device of the claim in one NVLink domain
    linked: bool
    mps: bool

    @property
    def devices(self) -> int:
        return sum(r.count for r in self.requests)


@dataclass(frozen=True)
class Handover:
    """A claim the allocator leaves to kube-scheduler, and why (in words a pod's owner understands)."""

    reason: str


def read_pending(claim: Mapping[str, Any], *, device_class: str = dra.DEVICE_CLASS) -> ClaimAsk | Handover | None:
    """The claim's ask; a :class:`Handover` for what the allocator does not place; None for a claim that is
    allocated already or asks nothing of ``device_class``. Never raises: a malformed claim is handed over
    with the field named (the API server validated it, so this is a claim from something else)."""
    try:
        return _read(claim, device_class)
    except ContractError as exc:
        return Handover(f"unreadable: {exc}")


def _read(claim: Mapping[str, Any], device_class: str) -> ClaimAsk | Handover | None:
    if not isinstance(claim, Mapping):
        raise ContractError(key="claim", value=type(claim).__name__, reason="expected an object")
    if (_object("status", claim.get("status") or {})).get("allocation"):
        return None
    meta = _object("metadata", claim.get("metadata") or {})
    devices = _object("spec.devices", _object("spec", claim.get("spec") or {}).get("devices") or {})
    requests = _bounded("spec.devices.requests", devices.get("requests") or [], MAX_REQUESTS)
    classes = [_request_classes(number, item) for number, item in enumerate(requests)]
    if not any(device_class in named for named in classes):
        return None
    others = sorted({c for named in classes for c in named if c != device_class})
    if others:
        return Handover(f"also requests devices of class {', '.join(others)}: one allocator for the whole claim")
    listed = [_object(f"spec.devices.requests[{n}]", r).get("name") for n, r in enumerate(requests)]
    prioritized = [str(name) for name, r in zip(listed, requests, strict=True) if r.get("firstAvailable")]
    if prioritized:
        return Handover(f"request {prioritized[0]} is a prioritized list (firstAvailable), which kube-scheduler ranks")
    asks = []
    for number, item in enumerate(requests):
        ask = _device_ask(f"spec.devices.requests[{number}]", item)
        if isinstance(ask, Handover):
            return ask
        asks.append(ask)
    if sum(a.count for a in asks) > MAX_DEVICES:
        return Handover(f"asks for more than {MAX_DEVICES} devices")
    linked = False
    for number, item in enumerate(_bounded("spec.devices.constraints", devices.get("constraints") or [], MAX_REQUESTS)):
        constraint = _object(f"spec.devices.constraints[{number}]", item)
        if set(constraint) - {"requests", "matchAttribute"} or constraint.get("matchAttribute") != NVLINK_ATTRIBUTE:
            return Handover(f"has a constraint other than matchAttribute {NVLINK_ATTRIBUTE}")
        linked = True
    return ClaimAsk(
        namespace=_text("metadata.namespace", meta.get("namespace")),
        name=_text("metadata.name", meta.get("name")),
        uid=_text("metadata.uid", meta.get("uid")),
        resource_version=_text("metadata.resourceVersion", meta.get("resourceVersion")),
        requests=tuple(asks),
        linked=linked,
        mps=_mps(devices.get("config") or []),
    )


def asks_class(claim: Mapping[str, Any], device_class: str) -> bool:
    """Whether any request of the claim, allocated or not, names ``device_class`` (itself or among its
    alternatives); a claim that cannot be read names none."""
    try:
        devices = _object("spec.devices", _object("spec", claim.get("spec") or {}).get("devices") or {})
        requests = _bounded("spec.devices.requests", devices.get("requests") or [], MAX_REQUESTS)
        return any(device_class in _request_classes(n, item) for n, item in enumerate(requests))
    except ContractError:
        return False


def _request_classes(number: int, item: object) -> set[str]:
    """The device classes a request names: its own, or its alternatives' (``firstAvailable``)."""
    where = f"spec.devices.requests[{number}]"
    request = _object(where, item)
    if request.get("firstAvailable"):
        alternatives = _bounded(f"{where}.firstAvailable", request["firstAvailable"], 8)
        return {
            _text(f"{where}.firstAvailable[{n}].deviceClassName", _object(where, a).get("deviceClassName"))
            for n, a in enumerate(alternatives)
        }
    exactly = _object(f"{where}.exactly", request.get("exactly") or {})
    return {_text(f"{where}.exactly.deviceClassName", exactly.get("deviceClassName"))}


def _device_ask(where: str, item: object) -> DeviceAsk | Handover:
    request = _object(where, item)
    name = _text(f"{where}.name", request.get("name"))
    exactly = _object(f"{where}.exactly", request.get("exactly"))
    mode = exactly.get("allocationMode") or "ExactCount"
    if mode != "ExactCount":
        return Handover(f"request {name} asks for allocationMode {mode}")
    if exactly.get("selectors"):
        return Handover(f"request {name} has CEL selectors, which only kube-scheduler evaluates")
    if exactly.get("adminAccess"):
        return Handover(f"request {name} asks for admin access")
    count = exactly.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES:
        raise ContractError(key=f"{where}.exactly.count", value=count, reason=f"expected 1 to {MAX_DEVICES}")
    capacity = _object(f"{where}.exactly.capacity", exactly.get("capacity") or {})
    wanted = _object(f"{where}.exactly.capacity.requests", capacity.get("requests") or {})
    unknown = sorted(str(k) for k in wanted if k not in (dra.CAPACITY_MEMORY, dra.CAPACITY_COMPUTE))
    if unknown:
        return Handover(f"request {name} asks for capacity {', '.join(unknown)}, which no GPU of this driver has")
    memory = wanted.get(dra.CAPACITY_MEMORY)
    compute = wanted.get(dra.CAPACITY_COMPUTE, 0)
    return DeviceAsk(
        request=name,
        count=count,
        memory=None if memory is None else _positive(f"{where}.exactly.capacity.requests.memory", memory),
        compute=_percent(f"{where}.exactly.capacity.requests.compute", compute),
    )


def _mps(entries: object) -> bool:
    """Whether the claim's own configuration for this driver makes its containers MPS clients."""
    mps = False
    for number, item in enumerate(_bounded("spec.devices.config", entries, MAX_REQUESTS)):
        opaque = _object(f"spec.devices.config[{number}]", item).get("opaque")
        if isinstance(opaque, Mapping) and opaque.get("driver") == dra.DRIVER:
            where = f"spec.devices.config[{number}].opaque.parameters"
            mps = dra.parse_gpu_config(opaque.get("parameters"), where=where).mps
    return mps


def _object(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ContractError(key=where, value=type(value).__name__, reason="expected an object")
    return value


def _bounded(where: str, value: object, most: int) -> list[Any]:
    if not isinstance(value, list):
        raise ContractError(key=where, value=type(value).__name__, reason="expected a list")
    if len(value) > most:
        raise ContractError(key=where, value=len(value), reason=f"more than {most} entries")
    return value


def _text(where: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 253:
        raise ContractError(key=where, value=value, reason="expected a non-empty name")
    return value


def _positive(where: str, value: object) -> int:
    amount = parse_whole_quantity(where, value)
    if amount <= 0:
        raise ContractError(key=where, value=value, reason="must be more than 0")
    return amount


def _percent(where: str, value: object) -> int:
    amount = parse_whole_quantity(where, value)
    if not 0 <= amount <= 100:
        raise ContractError(key=where, value=value, reason="expected a percentage of a GPU, 0-100")
    return amount
