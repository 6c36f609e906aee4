"""Who uses which GPU, per node: the shape both inspect views (the extender's JSON, the kubectl plugin) print.

The JSON keeps Aliyun's ``/inspect`` shape (``nodes[].devs[].pods[]``, ``totalGPU``/``usedGPU`` in the
node's unit) and adds what Aliyun could not know: the unit, each GPU's UUID and health, and pods pending
on the node without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gpushared.contract import GpuInventory
from gpushared.core.shared.ledger import Holding
from gpushared.core.shared.topology import topology_of


def node_report(*, name: str, address: str, inventory: GpuInventory, holdings: Iterable[Holding]) -> dict[str, Any]:
    held = list(holdings)
    held = sorted(held, key=lambda h: (h.namespace, h.name))
    devs = []
    used_total = 0
    for gpu in inventory.gpus:
        on_gpu = [h for h in held if gpu.index in h.gpus]
        used = sum(h.gpus[gpu.index] for h in on_gpu)
        used_total += used
        dev = {
            "id": gpu.index,
            "uuid": gpu.uuid,
            "healthy": gpu.healthy,
            "totalGPU": gpu.memory,
            "usedGPU": used,
            # what its processes use, in MiB, as the daemon last published it (None: not watched)
            "inUseMiB": gpu.used_mib,
            "numa": gpu.numa,
            "pods": [_pod_entry(h, h.gpus[gpu.index]) for h in on_gpu],
        }
        compute = sum(h.compute for h in on_gpu)
        if compute:  # percent of its compute its pods are guaranteed; absent where none asked (Aliyun's shape)
            dev["computeRequested"] = compute
        devs.append(dev)
    pending = [h for h in held if h.pending]
    topology = topology_of(inventory)
    return {
        "name": name,
        "address": address,
        "unit": inventory.unit.value,
        "totalGPU": inventory.total,
        "usedGPU": used_total + sum(h.pending for h in pending),
        "devs": devs,
        "pending": [{**_pod_entry(h, h.pending), "problem": h.problem} for h in pending],
        # how the GPUs are linked, as ``nvidia-smi topo -m`` prints it, row by row; absent when not known
        **({"links": topology.matrix([gpu.index for gpu in inventory.gpus])} if topology.known else {}),
    }


def _pod_entry(holding: Holding, used: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": holding.name, "namespace": holding.namespace, "usedGPU": used}
    if holding.compute:
        entry["computeRequest"] = holding.compute
    return entry


#: What the words of a link matrix mean, as nvidia-smi's legend says it.
LINK_LEGEND = (
    "NV#: # NVLink links  PIX: one PCIe switch  PXB: several PCIe switches  PHB: a PCIe host bridge  "
    "NODE: host bridges of one NUMA node  SYS: across NUMA nodes"
)


def link_matrix_lines(gpus: Sequence[int], matrix: Sequence[Sequence[str]], numa: Sequence[int | None]) -> list[str]:
    """``nvidia-smi topo -m``'s table: a row and a column per GPU, and each GPU's NUMA node."""
    rows = [["", *[f"GPU{i}" for i in gpus], "NUMA"]]
    rows += [
        [f"GPU{i}", *row, "-" if node is None else str(node)] for i, row, node in zip(gpus, matrix, numa, strict=True)
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["".join(cell.ljust(w + 2) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def set_links(gpus: Sequence[int], on: Sequence[int], matrix: Sequence[Sequence[str]]) -> str:
    """How the GPUs ``on`` (of the node's ``gpus``, whose links ``matrix`` has) are linked, pair by pair:
    "0-1 NV1, 0-3 NV2, 1-3 NV1"."""
    position = {gpu: i for i, gpu in enumerate(gpus)}
    chosen = sorted(on)
    return ", ".join(
        f"{a}-{b} {matrix[position[a]][position[b]]}" for i, a in enumerate(chosen) for b in chosen[i + 1 :]
    )
