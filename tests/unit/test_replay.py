"""The trace replay: the paper's workload tuning, kube-scheduler's filters, the extender's own policies."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.mixbook import ExpectedMix
from gpushared.core.placement.policies import BINPACK, FGD
from gpushared.replay.cluster import SimCluster
from gpushared.replay.run import oracle_mix, replay, trace_kinds, tuned
from gpushared.replay.trace import GPU_MIB, TraceNode, TracePod, read_nodes, read_pods

NODES = [
    TraceNode(name="a", cpu_milli=32000, memory_mib=65536, gpus=2, model="T4"),
    TraceNode(name="b", cpu_milli=32000, memory_mib=65536, gpus=4, model="V100M16"),
    TraceNode(name="c", cpu_milli=4000, memory_mib=65536, gpus=2, model="T4"),
]


def task(milli: int, *, cpu: int = 1000, gpus: int = 1, models: frozenset[str] = frozenset()) -> TracePod:
    return TracePod(name="t", cpu_milli=cpu, memory_mib=1024, num_gpu=gpus, gpu_milli=milli, models=models)


def test_csv_reading_and_the_share_to_memory_mapping(tmp_path: Path) -> None:
    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\nn1,96000,1,0,\n")
    (tmp_path / "pods.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
        "p0,12000,16384,1,500,V100M16|V100M32,LS,Running,0,1,0\np1,1000,1024,0,0,,BE,Running,0,1,0\n"
    )
    assert read_nodes(tmp_path / "nodes.csv") == [TraceNode("n0", 64000, 262144, 2, "P100")]  # CPU-only dropped
    half, cpu_only = read_pods(tmp_path / "pods.csv")
    assert half.models == {"V100M16", "V100M32"} and half.memory_request == GPU_MIB // 2
    assert cpu_only.memory_request == 0 and not cpu_only.models


def test_tuning_keeps_the_trace_and_draws_up_to_the_ratio() -> None:
    pods = [task(500), task(1000), task(0, gpus=0), task(1000, gpus=2)]
    workload = tuned(pods, capacity_milli=20_000, ratio=1.3, rng=random.Random(42))
    assert sum(p.gpu_demand for p in workload) <= 26_000
    assert sum(p.gpu_demand for p in workload) > 26_000 - 2000  # stops only when the next draw would pass
    assert workload == tuned(pods, capacity_milli=20_000, ratio=1.3, rng=random.Random(42))
    for pod in pods:
        assert pod in workload


def test_multi_gpu_tasks_take_their_gpus_on_one_node() -> None:
    """gpu-count: a task on N GPUs takes its share of each of N GPUs of one node, or is not placed."""
    cluster = SimCluster(NODES, policy=BINPACK, mix=RequestMix(), rng=random.Random(1))
    assert cluster.place(task(1000, gpus=4))  # only b has four GPUs
    b = cluster.nodes[1]
    assert [b.ledger.free(gpu) for gpu in b.ledger.inventory.gpus] == [0, 0, 0, 0]
    assert b.gpu_free == 0 and cluster.allocated_mib == 4 * GPU_MIB
    assert not cluster.place(task(1000, gpus=3))
    assert cluster.place(task(250, gpus=2))  # a quarter of each GPU of a or of c
    assert cluster.place(task(1000, gpus=1))  # a whole GPU is left only on the other of the two
    frees = sorted(
        tuple(n.ledger.free(gpu) for gpu in n.ledger.inventory.gpus) for n in (cluster.nodes[0], cluster.nodes[2])
    )
    assert frees == [(0, GPU_MIB), (GPU_MIB * 3 // 4, GPU_MIB * 3 // 4)]


def test_placement_honours_cpu_models_and_never_overfills_a_gpu() -> None:
    cluster = SimCluster(NODES, policy=BINPACK, mix=RequestMix(), rng=random.Random(1))
    assert not cluster.place(task(1000, models=frozenset({"A10"})))
    assert not cluster.place(task(1000, gpus=5))  # no node has five GPUs
    assert not cluster.place(task(100, cpu=40000))
    # The first and the last had GPU room, on nodes that the task's model or CPU ruled out.
    assert (cluster.gpu_failed, cluster.gpu_failed_with_room) == (3, 2)
    small = SimCluster(NODES[2:], policy=BINPACK, mix=RequestMix(), rng=random.Random(1))
    assert small.place(task(1000)) and small.place(task(1000))
    assert not small.place(task(500))
    assert (small.gpu_failed, small.gpu_failed_with_room) == (1, 0)  # no GPU had room
    rng = random.Random(7)
    for _ in range(200):
        cluster.place(task(rng.choice([100, 250, 500, 1000]), cpu=rng.choice([500, 2000])))
    for node in cluster.nodes:
        assert (
            0 <= node.cpu_free <= node.trace.cpu_milli
            and node.gpu_free == node.ledger.inventory.total - node.ledger.used_total
        )
        assert all(node.ledger.free(gpu) >= 0 for gpu in node.ledger.inventory.gpus)
    used = sum(node.ledger.used_total for node in cluster.nodes)
    assert used == cluster.allocated_mib and 0 < cluster.allocation <= 100


def test_binpack_fills_the_fullest_fitting_gpu_across_nodes() -> None:
    cluster = SimCluster(NODES[:2], policy=BINPACK, mix=RequestMix(), rng=random.Random(3))
    assert cluster.place(task(700))
    first = next(n for n in cluster.nodes if n.ledger.used_total)
    assert cluster.place(task(300))  # the only GPU with 300 left is where the 700 went
    assert first.ledger.used_total == round(700 * GPU_MIB / 1000) + round(300 * GPU_MIB / 1000)


def test_pods_without_gpu_go_where_the_least_gpu_memory_is_free() -> None:
    cluster = SimCluster(NODES[:2], policy=BINPACK, mix=RequestMix(), rng=random.Random(5))
    assert cluster.place(task(1000, cpu=1000))
    fullest = min(cluster.nodes, key=lambda n: n.gpu_free)
    pods = fullest.pods
    for _ in range(5):
        assert cluster.place(task(0, gpus=0, cpu=4000))
    assert fullest.pods == pods + 5  # all where the fewest GPUs are free, whatever LeastAllocated says
    assert sum(n.pods for n in cluster.nodes) == 6


def test_a_replay_records_every_percent_and_never_loses_allocation() -> None:
    pods = [task(500), task(250, cpu=2000), task(1000), task(0, gpus=0), task(1000, gpus=2)]
    result = replay(NODES, pods, policy=FGD.name, seed=42)
    assert len(result.allocation) == 131
    assert result.allocation == sorted(result.allocation) and result.allocation[-1] <= 100
    assert result.multi_gpu_tasks > 0 and result.multi_gpu_gpus == 2 * result.multi_gpu_tasks
    assert 0 <= result.frag_rate <= 100


def test_fgd_keeps_cpu_beside_free_gpu_memory_where_binpack_cannot_tell() -> None:
    """Either node leaves the same 4 GiB free after a 12 GiB task. On the first the task leaves too little
    CPU for the mix's pods, so those 4 GiB are stranded: fgd goes to the second; binpack sees a tie and
    kube-scheduler's in-tree scores (this node's CPU and memory are the more balanced) pick the first."""
    nodes = [
        TraceNode(name="short", cpu_milli=5000, memory_mib=1707, gpus=1, model="T4"),
        TraceNode(name="ample", cpu_milli=16000, memory_mib=1280, gpus=1, model="T4"),
    ]
    mix = RequestMix([(3000, GPU_MIB // 4, 1)] * 3)
    for policy, where in ((BINPACK, "short"), (FGD, "ample")):
        cluster = SimCluster(nodes, policy=policy, mix=mix, rng=random.Random(1))
        assert cluster.place(task(750, cpu=3000))
        assert [n.trace.name for n in cluster.nodes if n.ledger.used_total] == [where], policy.name


def test_the_counted_mix_knows_no_task_before_it_is_placed() -> None:
    """Issue #41: the causal replay's mix at every step holds only tasks placed before it, counted as the
    extender's cache counts bound pods (``core.placement.mixbook``), taken again every ROOMS_STEP of the capacity.
    Each task here is a kind of its own (its CPU), so any kind in the mix that no placed task has is a
    task from the future. The oracle mix, given from outside, fails the same check at the first step."""
    workload = [task(250 + 50 * (i % 10), cpu=1000 + i) for i in range(40)]
    for policy in (FGD, BINPACK):
        cluster = SimCluster(NODES, policy=policy, mix=None, rng=random.Random(3))
        placed: set[tuple[int, int, int, frozenset[str] | None]] = set()
        mixes = set()
        for pod in workload:
            assert set(cluster.mix.kinds()) <= placed, "the mix knows a task that has not been placed"
            mixes.add(id(cluster.mix))
            if cluster.place(pod):
                placed.add((pod.cpu_milli, pod.memory_per_gpu, pod.num_gpu, None))
        assert len(mixes) > 1 and placed  # taken again as the cluster filled
        assert set(cluster.book.kinds) == placed  # type: ignore[union-attr]
    oracle = SimCluster(NODES, policy=FGD, mix=oracle_mix(NODES, workload), rng=random.Random(3))
    assert len(oracle.mix.kinds()) == len(workload)  # the oracle knows every task before the first is placed


def test_a_causal_replay_starts_from_an_empty_mix_and_records_as_the_oracle_does() -> None:
    pods = [task(500), task(250, cpu=2000), task(1000), task(0, gpus=0), task(1000, gpus=2)]
    for policy in (FGD.name, BINPACK.name):
        causal = replay(NODES, pods, policy=policy, seed=42, causal=True)
        assert len(causal.allocation) == 131 and causal.allocation == sorted(causal.allocation)
        oracle = replay(NODES, pods, policy=policy, seed=42, causal=False)
        assert causal.placed + causal.failed == oracle.placed + oracle.failed  # the same workload
    with pytest.raises(ValueError, match="causal"):
        replay(NODES, pods, policy=FGD.name, seed=42, causal=False, expected=ExpectedMix({}))


def test_the_expected_mix_is_all_a_replay_knows_beside_the_tasks_placed() -> None:
    """An operator's expected mix (here another workload's kinds, as ``bench_openb.MEMORY_FROM`` makes it)
    is in every mix from the first; beside it, still only tasks already placed."""
    other = [task(1000, gpus=2, cpu=7000), task(125, cpu=900)]
    expected = ExpectedMix.of_counts(trace_kinds(other), weight=50)
    assert set(expected.shares) == {(7000, GPU_MIB, 2, None), (900, GPU_MIB // 8, 1, None)}
    workload = [task(250 + 50 * (i % 10), cpu=1000 + i) for i in range(40)]
    cluster = SimCluster(NODES, policy=FGD, mix=None, rng=random.Random(3), expected=expected)
    placed: set[tuple[int, int, int, frozenset[str] | None]] = set()
    for pod in workload:
        kinds = cluster.mix.kinds()
        assert set(kinds) <= placed | set(expected.shares), "the mix knows a task that has not been placed"
        assert kinds[(7000, GPU_MIB, 2, None)] == 25.0  # the expected mix, counted as its weight in pods
        if cluster.place(pod):
            placed.add((pod.cpu_milli, pod.memory_per_gpu, pod.num_gpu, None))
    assert placed


def test_with_compute_a_gpu_is_full_when_its_memory_or_its_compute_is() -> None:
    """Three thirds of a GPU: 5,461 MiB each fits 16 GiB three times, but as compute each is 34 % (rounded
    up: at least its share), so the third goes to another GPU; without compute all three share one."""
    assert task(333).compute_request == 34 and task(0, gpus=0).compute_request == 0
    single = [TraceNode(name="a", cpu_milli=32000, memory_mib=65536, gpus=2, model="T4")]
    for compute, gpus_used in ((False, 1), (True, 2)):
        cluster = SimCluster(single, policy=BINPACK, mix=RequestMix(), rng=random.Random(1), compute=compute)
        assert all(cluster.place(task(333)) for _ in range(3))
        (node,) = cluster.nodes
        assert sum(node.ledger.used(gpu.index) > 0 for gpu in node.ledger.inventory.gpus) == gpus_used
        assert all(node.ledger.compute_used(gpu.index) <= 100 for gpu in node.ledger.inventory.gpus)
        assert max(node.ledger.compute_used(gpu.index) for gpu in node.ledger.inventory.gpus) == (68 if compute else 0)
    rng = random.Random(5)
    cluster = SimCluster(NODES, policy=FGD, mix=RequestMix(), rng=random.Random(2), compute=True)
    for _ in range(300):
        cluster.place(task(rng.choice([130, 250, 333, 500, 1000]), cpu=rng.choice([500, 1000])))
    for node in cluster.nodes:
        for gpu in node.ledger.inventory.gpus:
            assert node.ledger.compute_used(gpu.index) <= 100 and node.ledger.free(gpu) >= 0
