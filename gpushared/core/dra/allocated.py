"""What a ResourceClaim's allocation gives this driver on this node: read from the claim as the API server
sends it (``resource.k8s.io/v1``), typed once, every malformed field a :class:`ContractError` naming it.

Only ``status.allocation`` is read: the scheduler wrote there which devices the claim got, what of each
device's capacity it consumed and which configuration applies to each request. A device of this driver in
another pool (another node) is an error for this node; devices of other drivers are someone else's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushared.contract import ContractError, GpuInventory, dra
from gpushared.core.shared.ledger import Holding
from gpushared.core.shared.quantity import parse_whole_quantity


@dataclass(frozen=True, order=True)
class ClaimRef:
    """The claim the kubelet names: namespace, name and UID (the UID tells a re-created claim apart)."""

    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def cdi_name(ref: ClaimRef, request: str) -> str:
    """The claim's CDI device for one request: ``<claim UID>-<request>`` (a subrequest's ``/`` as ``_``)."""
    return f"{ref.uid}-{request.replace('/', '_')}"


@dataclass(frozen=True)
class AllocatedDevice:
    """One device the scheduler gave the claim, with what it consumed of it."""

    request: str
    pool: str
    device: str
    #: bytes of memory consumed; None where the allocation carries none (a scheduler without consumable
    #: capacity allocates a device whole, to one claim)
    memory: int | None
    #: percent of the GPU's compute consumed
    compute: int
    share_id: str | None
    config: dra.GpuConfig


@dataclass(frozen=True)
class PodRef:
    name: str
    uid: str


def reserved_pods(claim: Mapping[str, Any]) -> list[PodRef]:
    """The pods the claim is reserved for (``status.reservedFor``, pods only): whose containers share it."""
    found = []
    for entry in (claim.get("status") or {}).get("reservedFor") or []:
        if (
            not isinstance(entry, dict)
            or entry.get("resource") != "pods"
            or entry.get("apiGroup", "") not in ("", None)
        ):
            continue
        name, uid = entry.get("name"), entry.get("uid")
        if isinstance(name, str) and name and isinstance(uid, str):
            found.append(PodRef(name, uid))
    return found[:256]  # the API server keeps at most 256 (ResourceClaimReservedForMaxSize)


def allocated_devices(claim: Mapping[str, Any], *, driver: str = dra.DRIVER) -> list[AllocatedDevice]:
    """The devices of ``driver`` in the claim's allocation, in the order the scheduler listed them."""
    allocation = _object("status.allocation", (claim.get("status") or {}).get("allocation"))
    devices = _object("status.allocation.devices", allocation.get("devices") or {})
    configs = _configs(devices.get("config") or [], driver=driver)
    result: list[AllocatedDevice] = []
    for number, item in enumerate(_list("status.allocation.devices.results", devices.get("results") or [])):
        where = f"status.allocation.devices.results[{number}]"
        entry = _object(where, item)
        if entry.get("driver") != driver:
            continue
        request, pool, device = (_text(f"{where}.{name}", entry.get(name)) for name in ("request", "pool", "device"))
        consumed = _object(f"{where}.consumedCapacity", entry.get("consumedCapacity") or {})
        memory = consumed.get(dra.CAPACITY_MEMORY)
        compute = consumed.get(dra.CAPACITY_COMPUTE)
        share = entry.get("shareID")
        result.append(
            AllocatedDevice(
                request=request,
                pool=pool,
                device=device,
                memory=None if memory is None else _amount(f"{where}.consumedCapacity.memory", memory),
                compute=0 if compute is None else _percent(f"{where}.consumedCapacity.compute", compute),
                share_id=share if isinstance(share, str) else None,
                config=_config_for(request, configs),
            )
        )
    return result


def _configs(entries: object, *, driver: str) -> list[tuple[frozenset[str], dra.GpuConfig]]:
    """The driver's configurations in the order they apply: the class's before the claim's, so that a
    claim's own configuration wins where both speak (as the allocation lists them: source FromClass first)."""
    parsed: list[tuple[int, int, frozenset[str], dra.GpuConfig]] = []
    for number, item in enumerate(_list("status.allocation.devices.config", entries)):
        where = f"status.allocation.devices.config[{number}]"
        entry = _object(where, item)
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        requests = frozenset(
            _text(f"{where}.requests", r) for r in _list(f"{where}.requests", entry.get("requests") or [])
        )
        rank = 0 if entry.get("source") == "FromClass" else 1
        config = dra.parse_gpu_config(opaque.get("parameters"), where=f"{where}.opaque.parameters")
        parsed.append((rank, number, requests, config))
    return [(requests, config) for _, _, requests, config in sorted(parsed, key=lambda p: (p[0], p[1]))]


def _config_for(request: str, configs: Sequence[tuple[frozenset[str], dra.GpuConfig]]) -> dra.GpuConfig:
    """The last configuration that names the request (or its main request), or names none."""
    main = request.split("/", 1)[0]
    chosen = dra.GpuConfig()
    for requests, config in configs:
        if not requests or request in requests or main in requests:
            chosen = config
    return chosen


def _object(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ContractError(key=where, value=value, reason="expected an object (is the claim allocated?)")
    return value


def _list(where: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise ContractError(key=where, value=value, reason="expected a list")
    return value


def _text(where: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ContractError(key=where, value=value, reason="expected a non-empty string")
    return value


def _amount(where: str, value: object) -> int:
    amount = parse_whole_quantity(where, value)
    if amount < 0:
        raise ContractError(key=where, value=value, reason="must not be negative")
    return amount


def _percent(where: str, value: object) -> int:
    amount = _amount(where, value)
    if amount > 100:
        raise ContractError(key=where, value=value, reason="is more than 100 percent of a GPU")
    return amount


def claim_holdings(
    claims: Sequence[Mapping[str, Any]], *, node: str, inventory: GpuInventory, driver: str = dra.DRIVER
) -> tuple[list[Holding], list[str]]:
    """(holdings, problems): what the ResourceClaims allocated on ``node``'s GPUs hold there, one holding per
    allocated device, named ``resourceclaim/<name>`` beside the pods (the inspect tool's view of a DRA
    node). A device that is not one of the node's GPUs, or a claim that does not parse, is a problem."""
    by_name = {dra.device_name(gpu.uuid): gpu for gpu in inventory.gpus}
    unit_bytes = inventory.unit.to_bytes(1)
    holdings: list[Holding] = []
    problems: list[str] = []
    for claim in claims:
        meta = claim.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        if not (claim.get("status") or {}).get("allocation"):
            continue
        try:
            devices = allocated_devices(claim, driver=driver)
        except ContractError as exc:
            problems.append(f"claim {key}: {exc}")
            continue
        for device in devices:
            if device.pool != node:
                continue
            gpu = by_name.get(device.device)
            if gpu is None:
                problems.append(f"claim {key}: device {device.device} is not a GPU of node {node}")
                continue
            memory = gpu.memory if device.memory is None else -(-device.memory // unit_bytes)
            holdings.append(
                Holding(
                    uid=f"{meta.get('uid')}/{device.request}/{device.device}",
                    namespace=str(meta.get("namespace", "")),
                    name=f"resourceclaim/{meta.get('name')}",
                    gpus={gpu.index: memory},
                    mps=device.config.mps,
                    assigned=True,
                    compute=device.compute,
                )
            )
    return holdings, problems
