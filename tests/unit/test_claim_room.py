"""The room the claim allocator keeps free for kube-scheduler (``core.placement.claims.room``): what a pod
kube-scheduler may be allocating for could take of each GPU, the room kept for all of them, and gated pods
placed with it counted; each row worked out by hand."""

from __future__ import annotations

import pytest

from gpushared.core.placement.claims.asks import ClaimAsk, DeviceAsk
from gpushared.core.placement.claims.choice import CandidateNode, NoRoom, choose
from gpushared.core.placement.claims.room import Room, could_take, kept_room, with_kept
from gpushared.core.placement.policies import BINPACK
from gpushared.core.shared.ledger import GpuMode, Holding, Ledger
from tests.builders import inventory

GI = 2**30


def claim(*sizes: int | None, count: int = 1, compute: int = 0, mps: bool = False) -> ClaimAsk:
    """A claim of one request per size (GiB; None: a GPU whole), ``count`` devices each."""
    requests = tuple(
        DeviceAsk(request=f"r{n}", count=count, memory=None if size is None else size * GI, compute=compute)
        for n, size in enumerate(sizes)
    )
    return ClaimAsk(namespace="team", name="c", uid="c", resource_version="1", requests=requests, linked=False, mps=mps)


def ledger(*sizes: int, used: dict[int, int] | None = None, compute: dict[int, int] | None = None) -> Ledger:
    """A node's GPUs (GiB) with what claims allocated on them use: memory and compute per GPU."""
    built = Ledger.build(inventory(*sizes, mps=True))
    for index in sorted(set(used or {}) | set(compute or {})):
        amount, share = (used or {}).get(index, 0), (compute or {}).get(index, 0)
        built.add(Holding(uid=f"u{index}", namespace="d", name="x", gpus={index: amount}, compute=share))
    return built


def every(node: Ledger) -> dict[int, str]:
    return {gpu.index: f"gpu-{gpu.index}" for gpu in node.inventory.gpus}


@pytest.mark.parametrize(
    ("asks", "node", "given", "expected"),
    [
        # one part: every GPU it fits, what it asks; none where it does not fit
        ([claim(4)], ledger(16, 16, 8), None, {0: Room(4, 0), 1: Room(4, 0), 2: Room(4, 0)}),
        ([claim(4)], ledger(16, 16, 8, used={1: 14}), None, {0: Room(4, 0), 2: Room(4, 0)}),
        # a 1 GiB pod on a GPU with 1 GiB left takes it; never more than what is free
        ([claim(1)], ledger(16, used={0: 15}), None, {0: Room(1, 0)}),
        # too big for every GPU: nothing anywhere
        ([claim(32)], ledger(16, 24), None, {}),
        # a part that fits no GPU: the pod cannot go there, so nothing
        ([claim(8), claim(20)], ledger(16, 16), None, {}),
        # two devices asked, one GPU with room: kube-scheduler may give it both
        ([claim(8, count=2)], ledger(16, 16, used={1: 12}), None, {0: Room(16, 0)}),
        # two parts that both fit a GPU: kube-scheduler may give it both (no distinctAttribute), up to its room
        ([claim(8), claim(4)], ledger(16, 16, used={1: 6}), None, {0: Room(12, 0), 1: Room(10, 0)}),
        # a part that fits only the larger GPU, the other everywhere
        ([claim(12), claim(2)], ledger(16, 8), None, {0: Room(14, 0), 1: Room(2, 0)}),
        # compute: a GPU without the compute asked takes none of the part
        ([claim(4, compute=60)], ledger(16, 16, compute={0: 50}), None, {1: Room(4, 60)}),
        # the compute taken is capped by what is free, like the memory
        ([claim(2, compute=30), claim(2, compute=30)], ledger(16, compute={0: 60}), None, {0: Room(4, 40)}),
        # a GPU taken whole (no memory asked): any GPU with nothing on it, whole
        ([claim(None)], ledger(16, 24, 16, used={2: 1}), None, {0: Room(16, 0), 1: Room(24, 0)}),
        # only the GPUs the slices publish
        ([claim(4)], ledger(16, 16, 16), {0: "gpu-0", 2: "gpu-2"}, {0: Room(4, 0), 2: Room(4, 0)}),
    ],
)
def test_what_a_pod_could_take_of_each_gpu(
    asks: list[ClaimAsk], node: Ledger, given: dict[int, str] | None, expected: dict[int, Room]
) -> None:
    assert could_take(asks, node, every(node) if given is None else given) == expected


@pytest.mark.parametrize(
    ("takes", "node", "expected"),
    [
        # five pods of 1 GiB that fit every GPU: 5 GiB kept on each
        ([({0: Room(1, 0), 1: Room(1, 0)}, 5)], ledger(16, 16), {0: Room(5, 0), 1: Room(5, 0)}),
        # kinds add up, each as many times as it has pods
        (
            [({0: Room(1, 0)}, 3), ({0: Room(4, 10), 1: Room(4, 10)}, 2)],
            ledger(16, 16),
            {0: Room(11, 20), 1: Room(8, 20)},
        ),
        # never more than the GPU's free room: kube-scheduler never puts its own pods past it
        ([({0: Room(1, 0), 1: Room(1, 0)}, 40)], ledger(16, 16, used={1: 10}), {0: Room(16, 0), 1: Room(6, 0)}),
        ([({0: Room(2, 30)}, 5)], ledger(16, compute={0: 40}), {0: Room(10, 60)}),
        # a GPU full already keeps nothing
        ([({0: Room(1, 0)}, 4)], ledger(16, used={0: 16}), {}),
        ([], ledger(16), {}),
    ],
)
def test_the_room_kept_on_each_gpu(
    takes: list[tuple[dict[int, Room], int]], node: Ledger, expected: dict[int, Room]
) -> None:
    assert kept_room(takes, node) == expected


def placed(node: Ledger, asks: list[ClaimAsk]) -> list[int] | str:
    candidate = CandidateNode(name="n", ledger=node, devices=every(node))
    result = choose(asks, [candidate], BINPACK)
    return result.reason if isinstance(result, NoRoom) else [pick.index for pick in result.picks]


@pytest.mark.parametrize(
    ("kept", "asks", "expected"),
    [
        # a tenant's five 1 GiB pods that kube-scheduler never places: a 4 GiB pod still fits
        ({0: Room(5, 0), 1: Room(5, 0)}, [claim(4)], [0]),
        # the room kept is counted: 12 GiB asked where 16 - 5 are left on each GPU
        ({0: Room(5, 0), 1: Room(5, 0)}, [claim(12)], "no node has room for the 1 device(s) the pod's claims ask for"),
        # best fit with the room kept counted: GPU 1 has 4 GiB left
        ({0: Room(2, 0), 1: Room(12, 0)}, [claim(4)], [1]),
        # compute kept too
        ({0: Room(1, 70), 1: Room(1, 20)}, [claim(2, compute=50)], [1]),
        # a GPU taken whole needs one with nothing kept
        ({0: Room(1, 0)}, [claim(None)], [1]),
        (
            {0: Room(1, 0), 1: Room(1, 0)},
            [claim(None)],
            "no node has room for the 1 device(s) the pod's claims ask for",
        ),
        # the room kept is no pod on the GPU: an MPS claim may still go where only room is kept
        ({0: Room(4, 0), 1: Room(4, 0)}, [claim(8, mps=True)], [0]),
    ],
)
def test_a_gated_pod_is_placed_with_the_room_kept_counted(
    kept: dict[int, Room], asks: list[ClaimAsk], expected: list[int] | str
) -> None:
    assert placed(with_kept(ledger(16, 16), kept), asks) == expected


def test_the_room_kept_counts_against_memory_and_compute_and_is_no_pod() -> None:
    node = with_kept(ledger(16, 16, used={0: 4}), {0: Room(3, 20), 1: Room(5, 0)})
    assert [node.used(0), node.used(1)] == [7, 5]
    assert [node.compute_free(0), node.compute_free(1)] == [80, 100]
    assert [node.sharers(0), node.sharers(1)] == [1, 0]  # GPU 0's claim only
    assert node.mode(1) is GpuMode.EMPTY
