"""The room the claim allocator keeps free for kube-scheduler on each GPU: what the pods kube-scheduler may be
allocating claims for could take there, as kube-scheduler may see the node.

kube-scheduler allocates first fit the claims of pods that reach it ungated, and the allocator cannot tell
which GPU it will take: so for each such pod it keeps, on every GPU where one of the pod's parts could go,
what the pod could put there (:func:`could_take`). A pod may get one device for several of its requests
(consumable capacity allows it; only a ``distinctAttribute`` constraint stops it), so that is the sum of
its parts that fit the GPU, on a node where each of its parts fits some GPU; a part that takes a GPU whole
(no memory asked) could take any GPU with nothing on it, whole. kube-scheduler never puts its own pods past
a GPU's capacity, so on one GPU the room kept for all of them is the sum of what each could take, never
more than the GPU's free memory and compute as kube-scheduler may see them (:func:`kept_room`). The
allocator then places a gated pod on the node's ledger with that room counted (:func:`with_kept`): a 4 GiB
pod still fits a 16 GiB GPU where five pods of 1 GiB could go, where holding whole nodes for them once
stopped it.

Pure: the component says which pods count and on which nodes (``extender.claims.fence``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from gpushared.core.placement.claims.asks import ClaimAsk
from gpushared.core.placement.claims.choice import parts
from gpushared.core.shared.ledger import Holding, Ledger

#: How the room kept on a GPU is named among the node's holdings (one holding per GPU).
KEPT_UID = "kept-for-kube-scheduler"


class Room(NamedTuple):
    """Of one GPU: memory in the node's unit, and percent of its compute."""

    units: int
    compute: int


#: The room kept for kube-scheduler, per node and GPU.
KeptRoom = Mapping[str, Mapping[int, Room]]
#: None kept.
NO_ROOM_KEPT: KeptRoom = {}


def could_take(asks: Sequence[ClaimAsk], ledger: Ledger, given: Mapping[int, str]) -> dict[int, Room]:
    """What one pod's pending claims could take of each GPU of the node (``ledger``: the node as kube-scheduler
    may see it; ``given``: the GPUs its slices publish), GPUs it could take nothing of left out: nothing where
    one of its parts fits no GPU (the pod cannot go there); on a GPU, the sum of the parts whose memory and
    compute fit there, and the whole GPU for a part that takes one whole where nothing is on it; never more
    than the GPU's free memory and compute. Several parts may go to one GPU, even the devices of one request:
    judged generously, since what it leaves out the allocator may give away."""
    pieces = parts(asks, ledger.unit)
    if not pieces:
        return {}
    taken: dict[int, Room] = {}
    placed: set[int] = set()
    for gpu in ledger.inventory.gpus:
        if gpu.index not in given:
            continue
        free, compute_free = max(ledger.free(gpu), 0), max(ledger.compute_free(gpu.index), 0)
        empty = ledger.used(gpu.index) == 0 and ledger.sharers(gpu.index) == 0
        units = compute = 0
        for number, part in enumerate(pieces):
            if part.compute > compute_free or (part.units is None and not empty):
                continue
            size = gpu.memory if part.units is None else part.units
            if size <= free:
                units, compute = units + size * part.gpus, compute + part.compute * part.gpus
                placed.add(number)
        room = Room(min(units, free), min(compute, compute_free))
        if room.units or room.compute:
            taken[gpu.index] = room
    return taken if len(placed) == len(pieces) else {}


def kept_room(takes: Iterable[tuple[Mapping[int, Room], int]], ledger: Ledger) -> dict[int, Room]:
    """The room to keep free on each GPU of the node: over ``takes`` (what one kind of pod could take of each
    GPU, and how many such pods there are), the sum of what each pod could take there, never more than the
    GPU's free memory and compute as kube-scheduler may see them (``ledger``). GPUs with none kept are left
    out."""
    units: dict[int, int] = {}
    compute: dict[int, int] = {}
    for take, count in takes:
        for index, room in take.items():
            units[index] = units.get(index, 0) + room.units * count
            compute[index] = compute.get(index, 0) + room.compute * count
    kept: dict[int, Room] = {}
    for gpu in ledger.inventory.gpus:
        if gpu.index not in units:
            continue
        room = Room(
            min(units[gpu.index], max(ledger.free(gpu), 0)),
            min(compute[gpu.index], max(ledger.compute_free(gpu.index), 0)),
        )
        if room.units or room.compute:
            kept[gpu.index] = room
    return kept


def added(one: KeptRoom, other: KeptRoom) -> KeptRoom:
    """Two rooms kept, added GPU by GPU (the room kept for kube-scheduler and the room held for preemptors;
    the holds of several preemptors). Either returned as it is where the other keeps nothing."""
    if not other:
        return one
    if not one:
        return other
    summed = {node: dict(on_node) for node, on_node in one.items()}
    for node, on_node in other.items():
        mine = summed.setdefault(node, {})
        for index, room in on_node.items():
            known = mine.get(index, Room(0, 0))
            mine[index] = Room(known.units + room.units, known.compute + room.compute)
    return summed


def with_kept(ledger: Ledger, kept: Mapping[int, Room]) -> Ledger:
    """A copy of the node's ledger with the room kept on each GPU counted as taken (``Holding.kept``: never a
    pod on the GPU), the ledger a gated pod is placed on while kube-scheduler may be allocating there."""
    holdings = [
        Holding(
            uid=f"{KEPT_UID}/{index}",
            namespace="",
            name="",
            gpus={index: room.units},
            compute=room.compute,
            kept=True,
        )
        for index, room in sorted(kept.items())
    ]
    return Ledger.build(ledger.inventory, [*ledger.holdings(), *holdings])
