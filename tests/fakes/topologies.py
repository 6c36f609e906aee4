"""The layouts of real machines (``gpushared.replay.layouts``) as tests use them: wired into the fake NVML,
or as the inventory a daemon on such a machine publishes."""

from __future__ import annotations

import dataclasses

from gpushared.contract import GpuInventory
from gpushared.core.shared.topology import link_words
from gpushared.replay.layouts import DGX1, DGX_A100, LAYOUTS, PCIE_2_SOCKET, UNKNOWN, layout, parse
from tests.builders import inventory

__all__ = ["DGX1", "DGX_A100", "LAYOUTS", "PCIE_2_SOCKET", "UNKNOWN", "layout", "layout_inventory", "parse"]


def layout_inventory(name: str, size: int = 16) -> GpuInventory:
    """An inventory of ``size`` GiB GPUs linked as layout ``name``, as the daemon publishes it (no links
    where the driver says nothing of any pair)."""
    topology = layout(name)
    plain = inventory(*([size] * len(topology.numa)))
    gpus = tuple(dataclasses.replace(gpu, numa=topology.numa[gpu.index]) for gpu in plain.gpus)
    words = link_words(topology, [gpu.index for gpu in gpus]) if topology.known else ()
    return GpuInventory(unit=plain.unit, gpus=gpus, links=words)
