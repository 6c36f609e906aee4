"""The pod's allocation (``gpushared.io/allocation``): container -> GPU -> amount, written by the extender at
bind, so that Allocate, called once per container, can be exact."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpushared.contract.compute import ComputeShare, parse_compute_record
from gpushared.contract.reading import (
    CONTRACT_VERSION,
    ContractError,
    require_bool,
    require_int,
    require_str,
    versioned_object,
)
from gpushared.contract.records import POD_ALLOCATION
from gpushared.contract.units import MemoryUnit


@dataclass(frozen=True)
class GpuShare:
    """``amount`` units of the GPU at ``index``; ``uuid`` lets the daemon refuse a GPU that moved."""

    index: int
    uuid: str
    amount: int


@dataclass(frozen=True)
class ContainerShares:
    """The GPU memory of one container. ``init`` and ``sidecar`` matter for what the pod holds at once:
    init containers run one after another before the app containers, sidecars (restartable init
    containers) keep running beside them (KEP-753), and kubelet hands init containers' devices on."""

    name: str
    gpus: tuple[GpuShare, ...]
    init: bool = False
    sidecar: bool = False


@dataclass(frozen=True)
class Allocation:
    """What the extender decided for one pod: every GPU-using container, init containers first, in the
    order of the pod spec."""

    unit: MemoryUnit
    containers: tuple[ContainerShares, ...]
    #: the pod's compute share on each of its GPUs, as bound; None for a pod that asked for none
    compute: ComputeShare | None = None

    def __post_init__(self) -> None:
        names = [c.name for c in self.containers]
        if len(set(names)) != len(names):
            raise ContractError(key=POD_ALLOCATION, value=names, reason="container names must be unique")

    def for_container(self, name: str) -> ContainerShares | None:
        for container in self.containers:
            if container.name == name:
                return container
        return None


def format_allocation(allocation: Allocation) -> str:
    def shares(container: ContainerShares) -> list[dict[str, object]]:
        return [{"index": s.index, "uuid": s.uuid, "amount": s.amount} for s in container.gpus]

    body: dict[str, object] = {
        "version": CONTRACT_VERSION,
        "unit": allocation.unit.value,
        "initContainers": [
            {"name": c.name, "sidecar": c.sidecar, "gpus": shares(c)} for c in allocation.containers if c.init
        ],
        "containers": [{"name": c.name, "gpus": shares(c)} for c in allocation.containers if not c.init],
    }
    if allocation.compute is not None:  # absent otherwise: readers from before compute shares see no change
        body["compute"] = {"request": allocation.compute.request, "limit": allocation.compute.limit}
    return json.dumps(body, separators=(",", ":"))


def parse_allocation(text: str) -> Allocation:
    key = POD_ALLOCATION
    body = versioned_object(key, text)
    unit = MemoryUnit.parse(body.get("unit"), key=key)
    parsed: list[ContainerShares] = []
    for field, init in (("initContainers", True), ("containers", False)):
        entries = body.get(field, [])
        if not isinstance(entries, list):
            raise ContractError(key=key, value=text, reason=f"'{field}' must be a list")
        for position, entry in enumerate(entries):
            where = f"{field}[{position}]"
            if not isinstance(entry, dict):
                raise ContractError(key=key, value=text, reason=f"{where} must be an object")
            gpus = entry.get("gpus")
            if not isinstance(gpus, list) or not gpus:
                raise ContractError(key=key, value=text, reason=f"{where}.gpus must list at least one GPU")
            parsed.append(
                ContainerShares(
                    name=require_str(key, f"{where}.name", entry.get("name")),
                    gpus=tuple(_parse_share(key, f"{where}.gpus[{i}]", share) for i, share in enumerate(gpus)),
                    init=init,
                    sidecar=init and require_bool(key, f"{where}.sidecar", entry.get("sidecar", False)),
                )
            )
    if not parsed:
        raise ContractError(key=key, value=text, reason="no container holds GPU memory")
    return Allocation(unit=unit, containers=tuple(parsed), compute=parse_compute_record(key, body.get("compute")))


def _parse_share(key: str, where: str, share: object) -> GpuShare:
    if not isinstance(share, dict):
        raise ContractError(key=key, value=share, reason=f"{where} must be an object")
    return GpuShare(
        index=require_int(key, f"{where}.index", share.get("index")),
        uuid=require_str(key, f"{where}.uuid", share.get("uuid")),
        amount=require_int(key, f"{where}.amount", share.get("amount")),
    )
