"""How a node's GPUs are linked, and which N of them a container on N GPUs should get.

Two GPUs joined by NVLink exchange data many times faster than two that meet only at a PCIe switch, and
those much faster than two on different CPU sockets. NVML says, per pair, how many NVLink links join them
(``nvmlDeviceGetNvLinkState`` with ``nvmlDeviceGetNvLinkRemotePciInfo``) and otherwise the closest PCIe
ancestor they share (``nvmlDeviceGetTopologyCommonAncestor``); ``nvidia-smi topo -m`` prints the same
matrix (``NV<n>``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``). Older drivers answer NOT_SUPPORTED, which
is :attr:`LinkKind.UNKNOWN` here.

A set of GPUs is worth the sum of the scores of its pairs (:func:`set_score`); :func:`choose_set` picks the
best set among the GPUs with room, and among equally good sets the one the placement policy prices lowest
(a balanced node's idle GPUs, a packed node's fullest), so that a node without topology information places
exactly as before. One-GPU pods never look at it.
Pure, so that every reader links GPUs alike: the extender chooses sets with it, and the daemon describes its
links with it (GetPreferredAllocation offers the set the bind recorded).
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from gpushared.contract import GpuInventory


class LinkKind(enum.Enum):
    """The closest connection of two GPUs, best first; the values are ``nvidia-smi topo -m``'s words."""

    NVLINK = "NV"
    SAME_BOARD = "PIX-BOARD"  # NVML_TOPOLOGY_INTERNAL: two GPUs of one board (a K80, say)
    SINGLE_SWITCH = "PIX"  # NVML_TOPOLOGY_SINGLE
    MULTIPLE_SWITCHES = "PXB"  # NVML_TOPOLOGY_MULTIPLE
    HOST_BRIDGE = "PHB"  # NVML_TOPOLOGY_HOSTBRIDGE
    SAME_CPU = "NODE"  # NVML_TOPOLOGY_NODE: across host bridges of one CPU socket
    CROSS_CPU = "SYS"  # NVML_TOPOLOGY_SYSTEM: across the sockets' interconnect
    UNKNOWN = "?"  # the driver does not say


#: What each kind of link is worth to a pair. NVLink counts per active link (each adds its bandwidth), and
#: one link beats every PCIe path. The PCIe steps are ordered as their latency and shared bandwidth are;
#: only the order matters to choose_set, and that sums over pairs are compared.
PCIE_SCORES: Final = {
    LinkKind.SAME_BOARD: 60,
    LinkKind.SINGLE_SWITCH: 50,
    LinkKind.MULTIPLE_SWITCHES: 40,
    LinkKind.HOST_BRIDGE: 30,
    LinkKind.SAME_CPU: 20,
    LinkKind.CROSS_CPU: 10,
    LinkKind.UNKNOWN: 0,
}
NVLINK_SCORE: Final = 100


@dataclass(frozen=True)
class Link:
    kind: LinkKind
    #: active NVLink links between the two GPUs (NVLINK only)
    nvlinks: int = 0

    @property
    def score(self) -> int:
        if self.kind is LinkKind.NVLINK:
            return NVLINK_SCORE * max(self.nvlinks, 1)
        return PCIE_SCORES[self.kind]

    def __str__(self) -> str:
        return f"NV{self.nvlinks}" if self.kind is LinkKind.NVLINK else self.kind.value


UNKNOWN_LINK: Final = Link(LinkKind.UNKNOWN)


@dataclass(frozen=True)
class Topology:
    """The links of a node's GPUs, by NVML index, and each GPU's NUMA node (None: not known)."""

    links: Mapping[frozenset[int], Link] = field(default_factory=dict)
    numa: Mapping[int, int | None] = field(default_factory=dict)

    def link(self, a: int, b: int) -> Link:
        return self.links.get(frozenset((a, b)), UNKNOWN_LINK)

    @property
    def known(self) -> bool:
        """Whether any pair's link is known: without, every set is as good as any other."""
        return any(link.kind is not LinkKind.UNKNOWN for link in self.links.values())

    def matrix(self, indices: Sequence[int]) -> list[list[str]]:
        """``nvidia-smi topo -m``'s matrix of ``indices``: ``X`` on the diagonal."""
        return [["X" if a == b else str(self.link(a, b)) for b in indices] for a in indices]


def set_score(gpus: Iterable[int], topology: Topology) -> int:
    """What a set of GPUs is worth: the sum of its pairs' link scores."""
    chosen = sorted(gpus)
    return sum(topology.link(a, b).score for a, b in itertools.combinations(chosen, 2))


#: Sets compared exhaustively up to this many (C(16, 8) = 12,870: a 16-GPU node asking for half of them);
#: beyond, the set is grown greedily from each GPU in turn.
EXHAUSTIVE_LIMIT: Final = 13_000


def choose_set(
    ordered: Sequence[int], count: int, topology: Topology, prices: Mapping[int, float] | None = None
) -> tuple[int, ...]:
    """The ``count`` GPUs, among ``ordered`` (the GPUs with room, best first by the placement policy), whose
    links are worth most together; among sets worth the same, the one the policy prices lowest in all
    (``prices``: each GPU's price, as the policy's order has them), then the one whose GPUs come earliest in
    ``ordered``. Returned in ``ordered``'s order. With one GPU, too few candidates or no known link it is
    the policy's own choice, the first ``count``."""
    if count <= 0 or count > len(ordered):
        raise ValueError(f"{count} GPUs asked of {len(ordered)} with room")
    first = tuple(ordered[:count])
    if count == 1 or count == len(ordered) or not topology.known:
        return first
    position = {gpu: i for i, gpu in enumerate(ordered)}
    price = prices or {}
    if math.comb(len(ordered), count) <= EXHAUSTIVE_LIMIT:
        candidates: Iterable[tuple[int, ...]] = itertools.combinations(ordered, count)
    else:
        candidates = (_grown(ordered, position, start, count, topology) for start in ordered)
    best = max(
        candidates,
        key=lambda gpus: (
            set_score(gpus, topology),
            -round(sum(price.get(g, 0.0) for g in gpus), 9),  # sums of equal prices, equal
            [-position[g] for g in gpus],
        ),
    )
    return tuple(sorted(best, key=position.__getitem__))


def _grown(
    ordered: Sequence[int], position: Mapping[int, int], start: int, count: int, topology: Topology
) -> tuple[int, ...]:
    """A set grown from ``start`` by adding, each step, the GPU that adds most (earliest on ties), in
    ``ordered``'s order (``position``: each GPU's place there)."""
    chosen = [start]
    rest = [gpu for gpu in ordered if gpu != start]
    while len(chosen) < count:
        gain = [sum(topology.link(gpu, c).score for c in chosen) for gpu in rest]
        pick = max(range(len(rest)), key=lambda i: (gain[i], -i))
        chosen.append(rest.pop(pick))
    return tuple(sorted(chosen, key=position.__getitem__))


_WORDS: Final = {kind.value: kind for kind in LinkKind}


@functools.lru_cache(maxsize=4096)
def topology_of(inventory: GpuInventory) -> Topology:
    """The links and NUMA nodes an inventory carries (``GpuInventory.links``: the matrix's upper triangle).
    Kept per inventory: the extender asks for every candidate node of every multi-GPU pod."""
    indices = [gpu.index for gpu in inventory.gpus]
    pairs = itertools.combinations(indices, 2)
    links = {frozenset(pair): parse_link(word) for pair, word in zip(pairs, inventory.links, strict=False)}
    return Topology(links=links, numa={gpu.index: gpu.numa for gpu in inventory.gpus})


def parse_link(word: str) -> Link:
    """One word of ``nvidia-smi topo -m`` (``contract.LINK_WORD``)."""
    if word.startswith("NV"):
        return Link(LinkKind.NVLINK, int(word[2:]))
    return Link(_WORDS[word])


def link_words(topology: Topology, indices: Sequence[int]) -> tuple[str, ...]:
    """``GpuInventory.links`` for ``indices``: the inverse of :func:`topology_of`."""
    return tuple(str(topology.link(a, b)) for a, b in itertools.combinations(indices, 2))


def parse_topo_matrix(text: str) -> tuple[Topology, dict[int, str]]:
    """``nvidia-smi topo -m``'s printout read back: the links between its GPUs, each GPU's NUMA affinity as
    printed (``"3"``, ``"0-1"``, ``"N/A"``) by GPU number. Columns are tab-separated; NIC rows and columns and
    the legend are skipped. Words this module does not know are :attr:`LinkKind.UNKNOWN`."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = next((line.split("\t") for line in lines if line.split("\t")[0].strip() == "" and "GPU0" in line), None)
    if header is None:
        raise ValueError("no GPU0 column: not the output of nvidia-smi topo -m")
    columns = [cell.strip() for cell in header]
    gpu_columns = {i: int(name[3:]) for i, name in enumerate(columns) if name.startswith("GPU") and name[3:].isdigit()}
    affinity_column = columns.index("NUMA Affinity") if "NUMA Affinity" in columns else None
    links: dict[frozenset[int], Link] = {}
    affinity: dict[int, str] = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("\t")]
        name = cells[0]
        if not (name.startswith("GPU") and name[3:].isdigit()):
            continue
        gpu = int(name[3:])
        for column, other in gpu_columns.items():
            if other != gpu and column < len(cells):
                word = cells[column]
                links[frozenset((gpu, other))] = parse_link(word) if _known_word(word) else UNKNOWN_LINK
        if affinity_column is not None and affinity_column < len(cells):
            affinity[gpu] = cells[affinity_column]
    return Topology(links=links), affinity


def _known_word(word: str) -> bool:
    return word in _WORDS or (word.startswith("NV") and word[2:].isdigit() and int(word[2:]) > 0)
