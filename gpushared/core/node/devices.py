"""The fake devices kubelet counts: one per unit of GPU memory, named so that each names its GPU.

An ID is ``<GPU index>-<unit number>`` ("2-15"): short enough that a node's list stays far below the
kubelet's 4 MiB message limit in GiB units, and telling the daemon, from the IDs kubelet passes to
Allocate, which GPU the kubelet gave.
"""

from __future__ import annotations

from typing import NamedTuple

from gpushared.contract import GpuInventory


class Device(NamedTuple):
    """One device of the ListAndWatch list: its ID, its health, and its GPU's NUMA node (None: not known),
    which the kubelet's Topology Manager aligns with the CPUs it gives the container."""

    id: str
    healthy: bool
    numa: int | None = None


def device_ids(index: int, units: int) -> list[str]:
    return [f"{index}-{j}" for j in range(units)]


def gpu_of(device_id: str) -> int | None:
    head, sep, tail = device_id.partition("-")
    if not sep or not head.isdigit() or not tail.isdigit():
        return None
    return int(head)


def device_list(inventory: GpuInventory, healthy: dict[int, bool]) -> list[Device]:
    return [
        Device(i, healthy.get(gpu.index, True), gpu.numa)
        for gpu in inventory.gpus
        for i in device_ids(gpu.index, gpu.memory)
    ]


def natural(device: str) -> tuple[int, int]:
    """Sort key of a device ID: by GPU, then unit number, as numbers ("1-10" after "1-9")."""
    head, _, tail = device.partition("-")
    return (int(head) if head.isdigit() else -1, int(tail) if tail.isdigit() else -1)
