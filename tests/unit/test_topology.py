"""Which N GPUs a container on N GPUs gets (core/shared/topology.py), on the shipped layouts of real machines."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared import contract
from gpushared.contract import GpuInventory, MemoryUnit
from gpushared.core.placement.policies import BINPACK, POLICIES, node_scores, policy_named
from gpushared.core.placement.pricing import PricingContext
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.core.shared.topology import (
    EXHAUSTIVE_LIMIT,
    Link,
    LinkKind,
    Topology,
    choose_set,
    parse_topo_matrix,
    set_score,
    topology_of,
)
from gpushared.core.shared.verdicts import judge
from tests.builders import inventory
from tests.fakes.topologies import LAYOUTS, layout, layout_inventory


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_layouts_are_read_as_nvidia_smi_prints_them(name: str) -> None:
    topology = layout(name)
    gpus = sorted(topology.numa)
    matrix = topology.matrix(gpus)
    assert all(matrix[i][i] == "X" for i in gpus)
    assert topology.known is (name != "unknown")


def test_dgx1_is_a_hybrid_cube_mesh() -> None:
    dgx1 = layout("dgx1")
    for gpu in range(8):  # six NVLink links each, to four GPUs
        links = [dgx1.link(gpu, other) for other in range(8) if other != gpu]
        nvlinked = [link for link in links if link.kind is LinkKind.NVLINK]
        assert len(nvlinked) == 4 and sum(link.nvlinks for link in nvlinked) == 6
    assert dgx1.numa == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}


# layout, GPUs with room in policy order, count, the set chosen
CHOICES = {
    "dgx1: a pair takes a double link": ("dgx1", [0, 1, 2, 5, 6, 7], 2, (1, 2)),
    "dgx1: four take a fully linked socket": ("dgx1", list(range(8)), 4, (0, 1, 2, 3)),
    "dgx1: the policy's order breaks ties between sockets": ("dgx1", [7, 6, 5, 4, 3, 2, 1, 0], 4, (7, 6, 5, 4)),
    "dgx1: NVLink over the sockets' link": ("dgx1", [5, 3, 0], 2, (3, 0)),
    "dgx1: of equal pairs, the policy's earliest": ("dgx1", [0, 5, 6, 7], 2, (5, 6)),
    "dgx-a100: all pairs equal, so the policy decides": ("dgx-a100", [5, 2, 7, 0], 2, (5, 2)),
    "pcie: one switch beats two and the sockets' link": ("pcie-2-socket", [2, 0, 5, 1, 3], 2, (0, 1)),
    "pcie: three on one socket before crossing": ("pcie-2-socket", [3, 0, 1, 2, 4], 3, (0, 1, 2)),
    "pcie: NODE beats SYS": ("pcie-2-socket", [0, 5, 3], 2, (5, 3)),
    "unknown: the policy's first": ("unknown", [3, 1, 0, 2], 2, (3, 1)),
    "one GPU never looks at links": ("dgx1", [5, 0, 3], 1, (5,)),
    "all of them": ("dgx1", [4, 0], 2, (4, 0)),
}


@pytest.mark.parametrize("case", CHOICES)
def test_choose_set(case: str) -> None:
    name, ordered, count, expected = CHOICES[case]
    assert choose_set(ordered, count, layout(name)) == expected


def test_more_gpus_than_have_room_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 GPUs asked of 2 with room"):
        choose_set([0, 1], 3, layout("dgx1"))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(LAYOUTS)))
def test_the_set_chosen_has_the_best_score_of_all_sets_with_room(data: st.DataObject, name: str) -> None:
    """Every subset of the GPUs, in every policy order, every count: the chosen set scores the most of all
    sets of the GPUs with room, comes from them, and of the best sets comes earliest in the policy's order."""
    topology = layout(name)
    gpus = sorted(topology.numa)
    room = data.draw(st.lists(st.sampled_from(gpus), min_size=1, unique=True), label="GPUs with room, in order")
    count = data.draw(st.integers(1, len(room)), label="count")
    chosen = choose_set(room, count, topology)
    assert len(chosen) == count and len(set(chosen)) == count and set(chosen) <= set(room)
    assert list(chosen) == sorted(chosen, key=room.index)  # returned in the policy's order
    scores = {combo: set_score(combo, topology) for combo in itertools.combinations(room, count)}
    best = max(scores.values())
    assert set_score(chosen, topology) == best or count == 1
    if count == 1:
        assert chosen == (room[0],)  # one-GPU pods: the policy's choice, whatever the links
    else:
        earliest = min((c for c, s in scores.items() if s == best), key=lambda c: sorted(map(room.index, c)))
        assert sorted(chosen, key=room.index) == list(earliest)


def test_a_large_node_is_chosen_greedily_and_still_well() -> None:
    """Past the exhaustive limit (32 GPUs, 16 asked): two NVSwitch islands of 16 behind the sockets' link;
    the greedy growth keeps the set on one island."""
    island = {frozenset((a, b)): Link(LinkKind.NVLINK, 18) for a, b in itertools.combinations(range(16), 2)}
    island |= {frozenset((a, b)): Link(LinkKind.NVLINK, 18) for a, b in itertools.combinations(range(16, 32), 2)}
    cross = {frozenset((a, b)): Link(LinkKind.CROSS_CPU) for a in range(16) for b in range(16, 32)}
    topology = Topology(links=island | cross)
    ordered = [x for pair in zip(range(16, 32), range(16), strict=True) for x in pair]  # islands interleaved
    assert math.comb(32, 16) > EXHAUSTIVE_LIMIT
    chosen = choose_set(ordered, 16, topology)
    assert set(chosen) == set(range(16, 32))  # the island of the policy's first GPU


# --- the inventory carries the links; placement uses them -------------------------------------------------


def dgx1_inventory(size: int = 16) -> GpuInventory:
    return layout_inventory("dgx1", size)


def test_the_inventory_carries_links_and_numa_and_reads_back_the_same_topology() -> None:
    carried = dgx1_inventory()
    text = contract.format_inventory(carried)
    assert '"links":"NV1 NV1 NV2 NV2 SYS SYS SYS NV2 NV1 SYS NV2 SYS SYS' in text
    back = contract.parse_inventory(text)
    assert back == carried
    assert topology_of(back) == layout("dgx1")


def test_an_inventory_without_links_is_written_as_before() -> None:
    """Older readers ignore keys they do not know; an inventory without topology has none of the new keys."""
    text = contract.format_inventory(inventory(16, 16))
    assert "links" not in text and "numa" not in text
    assert not topology_of(contract.parse_inventory(text)).known


@pytest.mark.parametrize(
    ("links", "reason"),
    [(("NV2", "SYS"), "'links' must name 1 pairs for 2 GPUs"), (("NVX",), "not a link")],
)
def test_links_that_do_not_fit_the_gpus_are_refused(links: tuple[str, ...], reason: str) -> None:
    with pytest.raises(contract.ContractError, match=reason):
        GpuInventory(unit=MemoryUnit.GIB, gpus=inventory(16, 16).gpus, links=links)


def held_ledger(name: str, held: list[tuple[int, int]]) -> Ledger:
    """A node of layout ``name`` with random holdings (GPU, GiB), those that fit."""
    ledger = Ledger.build(layout_inventory(name))
    for i, (index, amount) in enumerate(held):
        gpu = ledger.inventory.gpus[index % len(ledger.inventory.gpus)]
        if ledger.free(gpu) >= amount:
            ledger.add(Holding(uid=str(i), namespace="d", name=str(i), gpus={gpu.index: amount}))
    return ledger


HOLDINGS = st.lists(st.tuples(st.integers(0, 7), st.integers(1, 16)), max_size=10)


@pytest.mark.parametrize("name", LAYOUTS)
@settings(max_examples=100, deadline=None)
@given(
    held=HOLDINGS, count=st.sampled_from([2, 3, 4]), share=st.integers(1, 8), policy=st.sampled_from(sorted(POLICIES))
)
def test_every_policy_gives_a_pod_on_several_gpus_a_best_linked_set_with_room(
    name: str, held: list[tuple[int, int]], count: int, share: int, policy: str
) -> None:
    """On every layout with random holdings: the set chosen fits (no GPU over capacity), and no set of GPUs
    with room is better linked."""
    ledger = held_ledger(name, held)
    ask = PodRequest(containers=(ContainerRequest("c0", share * count, gpus=count),))
    verdicts = judge(ledger, ask)
    choice = policy_named(policy).choose(verdicts, ask, PricingContext(ledger))
    room = [v.gpu.index for v in verdicts if v.fits]
    if len(room) < count:
        assert choice is None
        return
    assert choice is not None and all(v.fits for v in choice) and len({v.gpu.index for v in choice}) == count
    assert all(ledger.free(v.gpu) >= share for v in choice)
    topology = layout(name)
    best = max(set_score(c, topology) for c in itertools.combinations(room, count))
    assert set_score([v.gpu.index for v in choice], topology) == best


@pytest.mark.parametrize("name", LAYOUTS)
@settings(max_examples=60, deadline=None)
@given(held=HOLDINGS, amount=st.integers(1, 16), policy=st.sampled_from(sorted(POLICIES)))
def test_one_gpu_pods_never_look_at_links(name: str, held: list[tuple[int, int]], amount: int, policy: str) -> None:
    """A one-GPU pod gets the same GPU, at the same rank, whether the node's links are known or not."""
    linked = held_ledger(name, held)
    unlinked = Ledger.build(dataclasses.replace(linked.inventory, links=()))
    for holding in linked.holdings():
        unlinked.add(holding)
    ask = PodRequest(containers=(ContainerRequest("c0", amount),))
    rules = policy_named(policy)
    ranked = [rules.price_node(judge(ledger, ask), ask, PricingContext(ledger)) for ledger in (linked, unlinked)]
    assert ranked[0] == ranked[1]
    assert ranked[0] is None or ranked[0][0].links == 0.0


def test_between_nodes_the_better_linked_set_wins_over_a_cheaper_price() -> None:
    """Binpack would take the node whose GPUs are fuller, but there the pair it gets crosses the sockets;
    the emptier node has an NVLink pair, and ranks first. On equally linked nodes price decides as before."""
    req = PodRequest(containers=(ContainerRequest("c0", 16, gpus=2),))
    crossing = Ledger.build(layout_inventory("dgx1"))
    for i, index in enumerate((1, 2, 3, 4, 5, 7)):  # room on 0 and 6 only: joined across the sockets
        crossing.add(Holding(uid=str(i), namespace="d", name=str(i), gpus={index: 16}))
    for gpu in (0, 6):
        crossing.add(Holding(uid=f"half-{gpu}", namespace="d", name="half", gpus={gpu: 4}))
    roomy = Ledger.build(layout_inventory("dgx1"))
    ranks = [BINPACK.price_node(judge(ledger, req), req, PricingContext(ledger)) for ledger in (crossing, roomy)]
    assert ranks[0] is not None and ranks[1] is not None
    assert ranks[0][0].price < ranks[1][0].price  # binpack alone would pick the crossing node
    assert ranks[0][0].links == -10 and ranks[1][0].links == -200  # SYS against NV2
    assert node_scores([rank for rank, _ in ranks]) == [0, 10]


def test_among_equally_linked_sets_the_policy_prices_decide() -> None:
    """A DGX-1 with a pair on GPUs 0 and 3: both sockets' quads are linked alike. Balanced takes the idle
    socket; best fit the socket already in use, which it packs."""
    ledger = Ledger.build(dgx1_inventory())
    ledger.add(Holding(uid="pair", namespace="d", name="pair", gpus={0: 8, 3: 8}))
    quad = PodRequest(containers=(ContainerRequest("c0", 16, gpus=4),))
    chosen = {
        name: sorted(
            v.gpu.index for v in policy_named(name).choose(judge(ledger, quad), quad, PricingContext(ledger)) or ()
        )
        for name in ("balanced", "binpack", "spread")
    }
    assert chosen == {"balanced": [4, 5, 6, 7], "binpack": [0, 1, 2, 3], "spread": [4, 5, 6, 7]}


#: As nvidia-smi 535 prints it on a DGX A100 (cut to four GPUs and one NIC).
TOPO_M = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV12\tNV12\tNV12\tPXB\t48-63,176-191\t3\t\tN/A\n"
    "GPU1\tNV12\t X \tNV12\tNV12\tPXB\t48-63,176-191\t3\t\tN/A\n"
    "GPU2\tNV12\tNV12\t X \tNV12\tSYS\t16-31,144-159\t1\t\tN/A\n"
    "GPU3\tNV12\tNV12\tNV12\t X \tSYS\t16-31,144-159\t1\t\tN/A\n"
    "NIC0\tPXB\tPXB\tSYS\tSYS\t X \t\t\t\t\n"
    "\n"
    "Legend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect\n"
)


def test_nvidia_smi_topo_m_is_read_back() -> None:
    topology, affinity = parse_topo_matrix(TOPO_M)
    assert topology.matrix([0, 1, 2, 3]) == layout("dgx-a100").matrix([0, 1, 2, 3])
    assert affinity == {0: "3", 1: "3", 2: "1", 3: "1"}
    with pytest.raises(ValueError, match="not the output of nvidia-smi topo -m"):
        parse_topo_matrix("No devices were found")
