"""GPU layouts of real machines, written as ``nvidia-smi topo -m`` prints them, and a model of a cluster's
links for placement benchmarks.

Each matrix row is one GPU: its links to every GPU (``X`` for itself: ``NV<n>`` n NVLink links, ``PIX``
one PCIe switch, ``PXB`` several, ``PHB`` the host bridge, ``NODE`` one CPU socket, ``SYS`` across sockets,
``?`` not known) and, last, its NUMA node (``-`` not known). The tests wire the fake NVML from them; the
replay gives trace nodes their links from :func:`model_layout`.
"""

from __future__ import annotations

import functools

from gpushared.core.shared.topology import Link, LinkKind, Topology, parse_link

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


@functools.cache
def layout(name: str) -> Topology:
    return parse(LAYOUTS[name])


@functools.cache
def model_layout(model: str, gpus: int) -> Topology:
    """The links a trace node of GPU ``model`` with ``gpus`` GPUs is given in the benchmarks: V100 servers as
    NVIDIA's DGX-1 (eight GPUs in a hybrid cube mesh; four: one socket of it), A100 servers as a DGX A100
    (NVSwitch), every other server as PCIe (:func:`pcie_layout`). Alibaba's trace names no link, so this is
    a model of common machines, not the trace's."""
    if gpus < 2:
        return Topology()
    if model.startswith("V100") and gpus in (4, 8):
        return _first(layout("dgx1"), gpus)
    if model.startswith("A100") and gpus <= 8:
        return _first(layout("dgx-a100"), gpus)
    return pcie_layout(gpus)


def pcie_layout(gpus: int) -> Topology:
    """A PCIe server: two GPUs behind each switch, the switches split between two sockets."""
    links: dict[frozenset[int], Link] = {}
    socket = [0 if i < (gpus + 1) // 2 else 1 for i in range(gpus)]
    for a in range(gpus):
        for b in range(a + 1, gpus):
            if a // 2 == b // 2:
                kind = LinkKind.SINGLE_SWITCH
            elif socket[a] == socket[b]:
                kind = LinkKind.SAME_CPU
            else:
                kind = LinkKind.CROSS_CPU
            links[frozenset((a, b))] = Link(kind)
    return Topology(links=links, numa={i: socket[i] for i in range(gpus)})


def _first(topology: Topology, gpus: int) -> Topology:
    """The layout of the first ``gpus`` GPUs of ``topology``."""
    return Topology(
        links={pair: link for pair, link in topology.links.items() if max(pair) < gpus},
        numa={i: node for i, node in topology.numa.items() if i < gpus},
    )
