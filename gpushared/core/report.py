"""Who uses which GPU, per node: the shape both inspect views (the extender's JSON, the kubectl plugin) print.

The JSON keeps Aliyun's ``/inspect`` shape (``nodes[].devs[].pods[]``, ``totalGPU``/``usedGPU`` in the
node's unit) and adds what Aliyun could not know: the unit, each GPU's UUID and health, and pods pending
on the node without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpushared.contract import GpuInventory
from gpushared.core.ledger import Holding


def node_report(*, name: str, address: str, inventory: GpuInventory, holdings: Iterable[Holding]) -> dict[str, Any]:
    held = list(holdings)
    held = sorted(held, key=lambda h: (h.namespace, h.name))
    devs = []
    used_total = 0
    for gpu in inventory.gpus:
        on_gpu = [h for h in held if gpu.index in h.gpus]
        used = sum(h.gpus[gpu.index] for h in on_gpu)
        used_total += used
        devs.append(
            {
                "id": gpu.index,
                "uuid": gpu.uuid,
                "healthy": gpu.healthy,
                "totalGPU": gpu.memory,
                "usedGPU": used,
                # what its processes use, in MiB, as the daemon last published it (None: not watched)
                "inUseMiB": gpu.used_mib,
                "pods": [{"name": h.name, "namespace": h.namespace, "usedGPU": h.gpus[gpu.index]} for h in on_gpu],
            }
        )
    pending = [h for h in held if h.pending]
    return {
        "name": name,
        "address": address,
        "unit": inventory.unit.value,
        "totalGPU": inventory.total,
        "usedGPU": used_total + sum(h.pending for h in pending),
        "devs": devs,
        "pending": [
            {"name": h.name, "namespace": h.namespace, "usedGPU": h.pending, "problem": h.problem} for h in pending
        ],
    }
