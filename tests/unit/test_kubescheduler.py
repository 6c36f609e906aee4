"""kube-scheduler's own DRA placement as the replay models it (``gpushared.replay.kubescheduler``): each rule
as a table of values worked out by hand from the scheduler's sources, and a cluster where first fit strands
a pod that gpushared's binpack places."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushared.core.placement.policies import BINPACK
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.replay.cluster import SimCluster
from gpushared.replay.kubescheduler import (
    FirstFitCluster,
    Requests,
    balanced,
    best_fit,
    first_fit,
    heap_top,
    least_allocated,
    node_score,
    nodes_to_find,
)
from gpushared.replay.trace import GPU_MIB, TraceNode, TracePod


@pytest.mark.parametrize(
    ("total", "percentage", "expected"),
    [
        (50, 0, 50),  # under 100 nodes: all of them
        (100, 0, 100),  # 50 % of 100, raised to the minimum of 100
        (1213, 0, 497),  # the trace's cluster: 50 - 1213/125 = 41 %
        (5000, 0, 500),  # 50 - 40 = 10 %
        (7000, 0, 350),  # 50 - 56 < 5: 5 %
        (1000, 30, 300),  # percentageOfNodesToScore given
        (150, 10, 100),  # 15, raised to 100
    ],
)
def test_the_nodes_a_search_stops_at(total: int, percentage: int, expected: int) -> None:
    assert nodes_to_find(total, percentage) == expected


@pytest.mark.parametrize(
    ("requested", "allocatable", "expected"),
    [
        ((0, 0), (1000, 1024), 100),
        ((500, 256), (1000, 1024), 62),  # (50 + 75) // 2
        ((1000, 1024), (1000, 1024), 0),
        ((1500, 0), (1000, 1024), 50),  # past capacity: 0 for that resource
        ((333, 0), (1000, 1024), 83),  # (66 + 100) // 2: each resource floored, then the mean
        ((100, 100), (0, 1024), 45),  # no CPU to allocate: 0 for it
    ],
)
def test_least_allocated(requested: tuple[int, int], allocatable: tuple[int, int], expected: int) -> None:
    assert least_allocated(requested, allocatable) == expected


@pytest.mark.parametrize(
    ("requested", "allocatable", "expected"),
    [
        ((500, 512), (1000, 1024), 100),
        ((1000, 0), (1000, 1024), 50),
        ((2000, 0), (1000, 1024), 50),  # a fraction past 1 counts as 1
        ((250, 768), (1000, 1024), 75),
        ((100, 0), (1000, 0), 100),  # one resource only: no deviation
    ],
)
def test_balanced(requested: tuple[int, int], allocatable: tuple[int, int], expected: int) -> None:
    assert balanced(requested, allocatable) == expected


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([5, 9, 9, 3], 1),
        ([1, 1, 5, 5], 3),  # the heap brings up the later of two equal best scores here
        ([7, 7, 7], 0),  # all equal: nothing moves
        ([2], 0),
        ([1, 2, 3, 4, 5, 6, 7], 6),
    ],
)
def test_equal_best_scores_go_to_the_node_the_heap_pops_first(scores: list[int], expected: int) -> None:
    assert heap_top(scores) == expected


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_the_node_popped_first_has_the_best_score(scores: list[int]) -> None:
    assert scores[heap_top(scores)] == max(scores)


def node(name: str = "n", *, gpus: int = 2, cpu: int = 32000, memory: int = 131072) -> TraceNode:
    return TraceNode(name=name, cpu_milli=cpu, memory_mib=memory, gpus=gpus, model="T4")


def task(name: str, *, cpu: int = 4000, memory: int = 8192, gpus: int = 1, milli: int = 500) -> TracePod:
    return TracePod(name=name, cpu_milli=cpu, memory_mib=memory, num_gpu=gpus, gpu_milli=milli)


def request(per_gpu: int, gpus: int = 1) -> PodRequest:
    return PodRequest(containers=(ContainerRequest("main", per_gpu * gpus, gpus=gpus),))


def test_devices_are_taken_first_fit_in_slice_order() -> None:
    cluster = FirstFitCluster([node(gpus=4)], mix=None, rng=random.Random(0))
    sim = cluster.nodes[0]
    assert first_fit(sim, request(GPU_MIB // 4)) == (0,)
    assert cluster.place(task("a", milli=750))
    # GPU 0 has a quarter left: a quarter fits there, before the empty GPUs; a half goes to GPU 1.
    assert first_fit(sim, request(GPU_MIB // 4)) == (0,)
    assert first_fit(sim, request(GPU_MIB // 2)) == (1,)
    assert first_fit(sim, request(GPU_MIB, gpus=2)) == (1, 2)
    assert first_fit(sim, request(GPU_MIB, gpus=4)) is None


def test_best_fit_takes_the_tightest_gpu_where_first_fit_takes_the_first() -> None:
    cluster = FirstFitCluster([node(gpus=2)], mix=None, rng=random.Random(0))
    assert cluster.place(task("half", milli=500)) and cluster.place(task("three quarters", milli=750))
    sim = cluster.nodes[0]  # GPU 0 has a half left, GPU 1 a quarter
    assert first_fit(sim, request(GPU_MIB // 4)) == (0,)
    assert best_fit(sim, request(GPU_MIB // 4)) == (1,)


def test_the_score_counts_an_unrequested_resource_as_kube_scheduler_does() -> None:
    sim = FirstFitCluster([node()], mix=None, rng=random.Random(0)).nodes[0]
    # 100 m and 200 MiB count in LeastAllocated for a pod that requests none; BalancedAllocation skips it.
    best_effort = task("b", cpu=0, memory=0)
    assert (
        node_score(sim, Requests(), best_effort) == ((32000 - 100) * 100 // 32000 + (131072 - 200) * 100 // 131072) // 2
    )
    assert node_score(sim, Requests(), task("c", cpu=16000, memory=65536)) == 50 + 100


def test_first_fit_over_spread_nodes_strands_a_pod_of_two_gpus_that_binpack_places() -> None:
    """Four half-GPU tasks on two nodes of two GPUs, then a task of two whole GPUs. kube-scheduler spreads the
    halves over both nodes (LeastAllocated) and first fit stacks each node's two on its GPU 0, so no node
    keeps two free GPUs; the extender's binpack puts all four on one node and places the fifth."""
    tasks = [task(f"half-{i}") for i in range(4)] + [task("two", gpus=2, milli=1000)]
    nodes = [node("a"), node("b")]
    first = FirstFitCluster(nodes, mix=None, rng=random.Random(0))
    packed = SimCluster(nodes, policy=BINPACK, mix=None, rng=random.Random(0))
    assert [first.place(t) for t in tasks] == [True, True, True, True, False]
    assert [packed.place(t) for t in tasks] == [True] * 5
    assert [n.gpu_free for n in first.nodes] == [GPU_MIB, GPU_MIB]  # GPU 1 of each, empty; GPU 0 full
    assert [n.pods for n in first.nodes] == [2, 2]


def test_the_search_moves_on_from_where_the_last_one_stopped() -> None:
    """In a cluster of 200 nodes a search stops at 100 feasible ones and the next starts after them."""
    cluster = FirstFitCluster([node(f"n{i:03}") for i in range(200)], mix=None, rng=random.Random(0))
    assert cluster.window == 100
    assert cluster.place(task("a"))
    assert cluster.next_start == 100
    assert [n.pods for n in cluster.nodes[:1]] == [1]  # all equal: the first of the window
    assert cluster.place(task("b"))
    assert cluster.next_start == 0 and cluster.nodes[100].pods == 1


def test_with_a_window_the_extender_prices_only_the_nodes_kube_scheduler_found() -> None:
    """binpack would put the second task beside the first; kube-scheduler's window sends it the next 100
    nodes instead, where no node has a task yet."""
    nodes = [node(f"n{i:03}") for i in range(200)]
    everything = SimCluster(nodes, policy=BINPACK, mix=None, rng=random.Random(0))
    windowed = SimCluster(nodes, policy=BINPACK, mix=None, rng=random.Random(0), window=100)
    for cluster in (everything, windowed):
        assert cluster.place(task("a")) and cluster.place(task("b"))
    assert sorted(n.pods for n in everything.nodes if n.pods) == [2]
    first, second = (i for i, n in enumerate(windowed.nodes) if n.pods)
    assert first < 100 <= second and windowed.next_start == 0
