"""What a DRA-mode node publishes: its GPUs as the devices of one ResourceSlice (``resource.k8s.io/v1``).

One device per healthy GPU, shared by many claims (``allowMultipleAllocations``), with two consumable
capacities (contract/dra.py):

- ``memory``: the GPU's memory in the node's unit, rounded down (what the device plugin advertises), in
  bytes; a claim consumes whole units (``validRange`` from one unit, in steps of one unit) and, naming no
  memory, the whole GPU;
- ``compute``: 100 percent; a claim consumes what it names, in whole percent, and naming none, nothing.

and the attributes a claim selects on (UUID, index, product, NUMA node, MPS, NVLink domain). An unhealthy
GPU leaves the slice, so nothing new is allocated on it; claims already prepared on it keep running.

The pool has one slice and a generation that changes whenever its devices do, and only then: a daemon that
restarts finds its slice as it left it and keeps the generation, so the scheduler sees no change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gpushared.contract import GpuInfo, GpuInventory, dra
from gpushared.core.shared.topology import LinkKind, topology_of

#: kube-apiserver's limit on a ResourceSlice's devices; a node with more GPUs needs more slices (none has).
MAX_DEVICES: Final = 128
#: The longest object name the API server takes.
MAX_NAME: Final = 253
COMPUTE_PERCENT: Final = 100


def format_bytes(amount: int) -> str:
    """A byte count as a canonical binary quantity where one is exact (``16Gi``, ``1536Mi``)."""
    for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if amount and amount % size == 0:
            return f"{amount // size}{suffix}"
    return str(amount)


def nvlink_domains(inventory: GpuInventory) -> dict[int, str]:
    """GPU index -> its NVLink domain: the GPUs reachable over NVLink, named by the lowest UUID among them.
    GPUs without NVLink are absent."""
    topology = topology_of(inventory)
    parent = {gpu.index: gpu.index for gpu in inventory.gpus}

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    linked: set[int] = set()
    for pair, link in topology.links.items():
        if link.kind is LinkKind.NVLINK:
            a, b = sorted(pair)
            linked.update((a, b))
            parent[root(b)] = root(a)
    members: dict[int, list[GpuInfo]] = {}
    for gpu in inventory.gpus:
        if gpu.index in linked:
            members.setdefault(root(gpu.index), []).append(gpu)
    return {
        gpu.index: f"nvlink-{min(g.uuid for g in group).lower()}"[:64] for group in members.values() for gpu in group
    }


def gpu_device(gpu: GpuInfo, inventory: GpuInventory, *, domain: str | None) -> dict[str, Any]:
    unit_bytes = inventory.unit.to_bytes(1)
    memory = inventory.unit.to_bytes(gpu.memory)
    # In steps of one unit from one unit; the API server wants min + step within the value, so a GPU of one
    # unit has no step (every request is then the whole GPU anyway).
    memory_range = {"min": format_bytes(unit_bytes)}
    if memory >= 2 * unit_bytes:
        memory_range["step"] = format_bytes(unit_bytes)
    attributes: dict[str, Any] = {
        dra.ATTRIBUTE_UUID: {"string": gpu.uuid},
        dra.ATTRIBUTE_INDEX: {"int": gpu.index},
        dra.ATTRIBUTE_PRODUCT: {"string": gpu.model[:64]},
        dra.ATTRIBUTE_MPS: {"bool": gpu.mps_capable},
    }
    if gpu.numa is not None:
        attributes[dra.ATTRIBUTE_NUMA] = {"int": gpu.numa}
    if domain is not None:
        attributes[dra.ATTRIBUTE_NVLINK_DOMAIN] = {"string": domain}
    return {
        "name": dra.device_name(gpu.uuid),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            dra.CAPACITY_MEMORY: {
                "value": format_bytes(memory),
                "requestPolicy": {"default": format_bytes(memory), "validRange": memory_range},
            },
            dra.CAPACITY_COMPUTE: {
                "value": str(COMPUTE_PERCENT),
                "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": str(COMPUTE_PERCENT), "step": "1"}},
            },
        },
    }


def slice_devices(inventory: GpuInventory) -> list[dict[str, Any]]:
    """The devices of the node's slice: its healthy GPUs with memory, in index order."""
    domains = nvlink_domains(inventory)
    return [
        gpu_device(gpu, inventory, domain=domains.get(gpu.index))
        for gpu in inventory.gpus
        if gpu.healthy and gpu.memory > 0
    ][:MAX_DEVICES]


def slice_name(node: str, driver: str = dra.DRIVER) -> str:
    """The node's slice: ``<node>-<driver>``, shortened with a hash where that is too long."""
    name = f"{node}-{driver}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[: MAX_NAME - 11].rstrip('.-')}-{digest}"


def pool_generation(existing: Sequence[Mapping[str, Any]], devices: Sequence[Mapping[str, Any]]) -> tuple[int, bool]:
    """(generation, changed): the pool's generation for ``devices`` given its ``existing`` slices. The same
    devices in the newest slice keep its generation; anything else is the next one."""
    newest = max((_generation(s) for s in existing), default=0)
    current = [s for s in existing if _generation(s) == newest]
    if len(existing) == 1 and current and list((current[0].get("spec") or {}).get("devices") or []) == list(devices):
        return newest, False
    return newest + 1, True


def slice_body(
    *, node: str, node_uid: str | None, generation: int, devices: Sequence[Mapping[str, Any]], driver: str = dra.DRIVER
) -> dict[str, Any]:
    """The node's ResourceSlice. Owned by its Node, so the API server deletes it with the node."""
    metadata: dict[str, Any] = {"name": slice_name(node, driver)}
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
        ]
    return {
        "apiVersion": f"{dra.API_GROUP}/{dra.API_VERSION}",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": list(devices),
        },
    }


def _generation(body: Mapping[str, Any]) -> int:
    pool = (body.get("spec") or {}).get("pool") or {}
    value = pool.get("generation", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
