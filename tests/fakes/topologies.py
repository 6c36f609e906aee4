"""GPU layouts of real machines, written as ``nvidia-smi topo -m`` prints them, for tests of set selection.

Each matrix row is one GPU: its links to every GPU (``X`` for itself: ``NV<n>`` n NVLink links, ``PIX``
one PCIe switch, ``PXB`` several, ``PHB`` the host bridge, ``NODE`` one CPU socket, ``SYS`` across sockets,
``?`` not known) and, last, its NUMA node (``-`` not known).
"""

from __future__ import annotations

import dataclasses

from gpushared.contract import GpuInventory
from gpushared.core.topology import Link, Topology, link_words, parse_link
from tests.builders import inventory

#: DGX-1 with V100: hybrid cube-mesh. Each GPU has six NVLink links to four others, GPUs 0-3 and 4-7 are
#: fully linked within their socket, and each GPU links to one GPU of the other socket.
DGX1 = """
X   NV1 NV1 NV2 NV2 SYS SYS SYS 0
NV1 X   NV2 NV1 SYS NV2 SYS SYS 0
NV1 NV2 X   NV2 SYS SYS NV1 SYS 0
NV2 NV1 NV2 X   SYS SYS SYS NV1 0
NV2 SYS SYS SYS X   NV1 NV1 NV2 1
SYS NV2 SYS SYS NV1 X   NV2 NV1 1
SYS SYS NV1 SYS NV1 NV2 X   NV2 1
SYS SYS SYS NV1 NV2 NV1 NV2 X   1
"""

#: DGX A100: six NVSwitches, every pair joined by twelve links; NUMA nodes as its NPS4 setting shows them.
DGX_A100 = """
X    NV12 NV12 NV12 NV12 NV12 NV12 NV12 3
NV12 X    NV12 NV12 NV12 NV12 NV12 NV12 3
NV12 NV12 X    NV12 NV12 NV12 NV12 NV12 1
NV12 NV12 NV12 X    NV12 NV12 NV12 NV12 1
NV12 NV12 NV12 NV12 X    NV12 NV12 NV12 7
NV12 NV12 NV12 NV12 NV12 X    NV12 NV12 7
NV12 NV12 NV12 NV12 NV12 NV12 X    NV12 5
NV12 NV12 NV12 NV12 NV12 NV12 NV12 X    5
"""

#: A 2-socket PCIe server: two GPUs behind one switch and one behind another on each socket.
PCIE_2_SOCKET = """
X    PIX  PXB  SYS  SYS  SYS 0
PIX  X    PXB  SYS  SYS  SYS 0
PXB  PXB  X    SYS  SYS  SYS 0
SYS  SYS  SYS  X    PIX  NODE 1
SYS  SYS  SYS  PIX  X    NODE 1
SYS  SYS  SYS  NODE NODE X   1
"""

#: An older driver: every link query answers NOT_SUPPORTED, no NUMA node known.
UNKNOWN = """
X ? ? ? -
? X ? ? -
? ? X ? -
? ? ? X -
"""

LAYOUTS = {"dgx1": DGX1, "dgx-a100": DGX_A100, "pcie-2-socket": PCIE_2_SOCKET, "unknown": UNKNOWN}


def parse(matrix: str) -> Topology:
    rows = [line.split() for line in matrix.strip().splitlines()]
    links: dict[frozenset[int], Link] = {}
    numa: dict[int, int | None] = {}
    for a, row in enumerate(rows):
        *cells, node = row
        assert len(cells) == len(rows), f"row {a} has {len(cells)} links for {len(rows)} GPUs"
        numa[a] = None if node == "-" else int(node)
        for b, cell in enumerate(cells):
            if a == b:
                assert cell == "X"
                continue
            link = parse_link(cell)
            pair = frozenset((a, b))
            assert links.setdefault(pair, link) == link, f"GPUs {a} and {b}: the matrix is not symmetric"
    return Topology(links=links, numa=numa)


def layout(name: str) -> Topology:
    return parse(LAYOUTS[name])


def layout_inventory(name: str, size: int = 16) -> GpuInventory:
    """An inventory of ``size`` GiB GPUs linked as layout ``name``, as the daemon publishes it (no links
    where the driver says nothing of any pair)."""
    topology = layout(name)
    plain = inventory(*([size] * len(topology.numa)))
    gpus = tuple(dataclasses.replace(gpu, numa=topology.numa[gpu.index]) for gpu in plain.gpus)
    words = link_words(topology, [gpu.index for gpu in gpus]) if topology.known else ()
    return GpuInventory(unit=plain.unit, gpus=gpus, links=words)
