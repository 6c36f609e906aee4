"""The node's GPU inventory (``gpushared.io/gpu-inventory``): the GPUs the daemon found, each with its own
size, health, MPS and NUMA node, and how they are linked."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Final

from gpushared.contract.reading import (
    CONTRACT_VERSION,
    ContractError,
    require_bool,
    require_int,
    require_str,
    versioned_object,
)
from gpushared.contract.records import NODE_INVENTORY
from gpushared.contract.units import MemoryUnit


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as the node daemon reports it.

    ``index`` is NVML's enumeration index (the same one the daemon resolves to ``uuid``); ``memory`` is in
    the node's unit, rounded down; ``memory_mib`` is NVML's exact total, which MPS limits are derived from.
    ``used_mib`` is what the GPU's processes used when the daemon last published it (None: not watched); it
    is not part of a GPU's identity, so a change of use alone changes no ledger.
    """

    index: int
    uuid: str
    model: str
    memory: int
    memory_mib: int
    healthy: bool = True
    mps_capable: bool = False
    used_mib: int | None = dataclasses.field(default=None, compare=False)
    #: the NUMA node the GPU hangs off (None: not known), for the kubelet's Topology Manager
    numa: int | None = None


#: One link of the inventory's ``links``: ``nvidia-smi topo -m``'s words (``NV<n>``: n NVLink links; PIX,
#: PXB, PHB, NODE, SYS: PCIe paths, best first; PIX-BOARD: one board; ``?``: not known).
LINK_WORD: Final = re.compile(r"NV[1-9][0-9]{0,2}|PIX-BOARD|PIX|PXB|PHB|NODE|SYS|\?")


@dataclass(frozen=True)
class GpuInventory:
    """All GPUs of one node. One unit per node: a node advertises one gpu-mem resource.

    ``links`` is how the GPUs are connected (``core.shared.topology``): the upper triangle of the link matrix over
    ``gpus`` in order, row by row (GPU 0 to 1, 2, ...; then 1 to 2, ...), empty when not read. In the
    annotation it is one string of words (28 for 8 GPUs); readers older than it ignore the key."""

    unit: MemoryUnit
    gpus: tuple[GpuInfo, ...]
    links: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        indices = [gpu.index for gpu in self.gpus]
        if indices != sorted(set(indices)):
            raise ContractError(key=NODE_INVENTORY, value=indices, reason="GPU indices must be unique, ascending")
        uuids = [gpu.uuid for gpu in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ContractError(key=NODE_INVENTORY, value=uuids, reason="GPU UUIDs must be unique")
        pairs = len(self.gpus) * (len(self.gpus) - 1) // 2
        if self.links and len(self.links) != pairs:
            raise ContractError(
                key=NODE_INVENTORY,
                value=" ".join(self.links),
                reason=f"'links' must name {pairs} pairs for {len(self.gpus)} GPUs",
            )
        for word in self.links:
            if not LINK_WORD.fullmatch(word):
                raise ContractError(
                    key=NODE_INVENTORY, value=word, reason="not a link: NV<n>, PIX, PXB, PHB, NODE, SYS or ?"
                )

    def by_index(self, index: int) -> GpuInfo | None:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        return None

    @property
    def total(self) -> int:
        return sum(gpu.memory for gpu in self.gpus)


def format_inventory(inventory: GpuInventory) -> str:
    return json.dumps(
        {
            "version": CONTRACT_VERSION,
            "unit": inventory.unit.value,
            "gpus": [
                {
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "model": gpu.model,
                    "memory": gpu.memory,
                    "memoryMiB": gpu.memory_mib,
                    "healthy": gpu.healthy,
                    "mps": gpu.mps_capable,
                    **({"usedMiB": gpu.used_mib} if gpu.used_mib is not None else {}),
                    **({"numa": gpu.numa} if gpu.numa is not None else {}),
                }
                for gpu in inventory.gpus
            ],
            **({"links": " ".join(inventory.links)} if inventory.links else {}),
        },
        separators=(",", ":"),
    )


def parse_inventory(text: str) -> GpuInventory:
    key = NODE_INVENTORY
    body = versioned_object(key, text)
    unit = MemoryUnit.parse(body.get("unit"), key=key)
    gpus = body.get("gpus")
    if not isinstance(gpus, list):
        raise ContractError(key=key, value=text, reason="'gpus' must be a list")
    parsed = []
    for position, gpu in enumerate(gpus):
        where = f"gpus[{position}]"
        if not isinstance(gpu, dict):
            raise ContractError(key=key, value=text, reason=f"{where} must be an object")
        parsed.append(
            GpuInfo(
                index=require_int(key, f"{where}.index", gpu.get("index")),
                uuid=require_str(key, f"{where}.uuid", gpu.get("uuid")),
                model=require_str(key, f"{where}.model", gpu.get("model", "")),
                memory=require_int(key, f"{where}.memory", gpu.get("memory")),
                memory_mib=require_int(key, f"{where}.memoryMiB", gpu.get("memoryMiB")),
                healthy=require_bool(key, f"{where}.healthy", gpu.get("healthy", True)),
                mps_capable=require_bool(key, f"{where}.mps", gpu.get("mps", False)),
                used_mib=require_int(key, f"{where}.usedMiB", gpu["usedMiB"]) if "usedMiB" in gpu else None,
                numa=require_int(key, f"{where}.numa", gpu["numa"]) if "numa" in gpu else None,
            )
        )
    links = body.get("links", "")
    if not isinstance(links, str):
        raise ContractError(key=key, value=links, reason="'links' must be a string of link words")
    return GpuInventory(unit=unit, gpus=tuple(parsed), links=tuple(links.split()))
