"""The replay with priorities: kube-scheduler's preemption with the extender's victims, on hand-made clusters."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gpushared.core.placement.policies import BINPACK, FGD
from gpushared.replay.priority import HIGH, LOW, MIDDLE, PriorityCluster, priority_replay, read_priorities
from gpushared.replay.run import replay
from gpushared.replay.trace import GPU_MIB, TraceNode, TracePod

REPO = Path(__file__).resolve().parents[2]
PRIORITIES = {"high": HIGH, "middle": MIDDLE, "low": LOW, "high-2": HIGH}


def task(name: str, milli: int, *, cpu: int = 1000, gpus: int = 1) -> TracePod:
    return TracePod(name=name, cpu_milli=cpu, memory_mib=1024, num_gpu=gpus, gpu_milli=milli)


def cluster(nodes: list[TraceNode], *, preempt: bool, requeue: bool = False) -> PriorityCluster:
    return PriorityCluster(
        nodes,
        priority_of=lambda pod: PRIORITIES.get(pod.name, LOW),
        preempt=preempt,
        requeue=requeue,
        policy=BINPACK,
        mix=None,
        rng=random.Random(1),
    )


def one_gpu(name: str, *, cpu: int = 32000) -> TraceNode:
    return TraceNode(name=name, cpu_milli=cpu, memory_mib=65536, gpus=1, model="T4")


def gpu_uids(sim: PriorityCluster) -> list[list[tuple[str, str]]]:
    """Each node's GPU pods: (task name, uid)."""
    return [sorted((p.pod.name, u) for u, p in pods.items() if p.uid) for pods in sim.on_node]


def test_a_high_pod_evicts_the_lowest_pod_that_makes_room_and_nothing_else() -> None:
    """Node a is full of middle pods, node b half full with a low one. The high pod evicts the low pod (the
    lowest highest victim priority), though one middle pod on a would do as well."""
    sim = cluster([one_gpu("a"), one_gpu("b")], preempt=True)
    assert sim.place(task("middle", 750))
    assert sim.place(task("low", 500))
    assert sim.place(task("middle", 250))  # binpack: the fullest GPU it fits, a's
    assert gpu_uids(sim) == [[("middle", "pod-1"), ("middle", "pod-3")], [("low", "pod-2")]]
    assert sim.place(task("high", 750))
    assert gpu_uids(sim) == [[("middle", "pod-1"), ("middle", "pod-3")], [("high", "pod-4")]]
    tally = sim.tally
    assert (tally.preemptions, tally.evicted_pods, tally.evicted_milli) == (1, {LOW: 1}, {LOW: 500})
    assert sim.allocated_mib == GPU_MIB + GPU_MIB * 3 // 4
    b = sim.nodes[1]
    assert b.gpu_free == GPU_MIB // 4 and b.pods == 1 and b.cpu_free == 31000
    assert {h.uid: h.priority for h in b.ledger.holdings()} == {"pod-4": HIGH}


def test_without_preemption_the_high_pod_fails_and_nothing_moves() -> None:
    sim = cluster([one_gpu("a")], preempt=False)
    assert sim.place(task("low", 750))
    assert not sim.place(task("high", 500))
    assert gpu_uids(sim) == [[("low", "pod-1")]]
    assert sim.tally.evicted_pods == {} and sim.gpu_failed == 1


def test_equal_or_higher_priority_is_never_evicted() -> None:
    sim = cluster([one_gpu("a"), one_gpu("b")], preempt=True)
    assert sim.place(task("high", 750)) and sim.place(task("high-2", 750))
    assert not sim.place(task("high", 500))
    assert not sim.place(task("middle", 500))
    assert not sim.place(task("low", 500))  # the lowest pod preempts nothing, so no node is even searched
    assert sim.tally.evicted_pods == {} and sim.tally.preemptions == 0


def test_a_node_short_of_cpu_loses_a_lower_cpu_only_pod_too() -> None:
    """The GPU victim frees too little CPU: kube-scheduler's victims for CPU are added, lowest priority first
    (the low CPU-only pod, not the middle one)."""
    sim = cluster([one_gpu("a", cpu=8000)], preempt=True)
    assert sim.place(task("low", 750, cpu=1000))
    assert sim.place(task("middle", 0, cpu=1000, gpus=0))
    assert sim.place(task("low", 0, cpu=4000, gpus=0))
    assert sim.place(task("high", 500, cpu=6000))
    assert [sorted(p.pod.name for p in pods.values()) for pods in sim.on_node] == [["high", "middle"]]
    assert sim.tally.evicted_pods == {LOW: 2} and sim.nodes[0].cpu_free == 1000


def test_requeue_places_a_victim_where_there_is_room() -> None:
    """The high pod may only run on the low pod's GPU model: it evicts the low pod, which is scheduled once
    more and goes to the other node."""
    nodes = [TraceNode("a", 32000, 65536, 1, "V100M16"), TraceNode("b", 32000, 65536, 1, "T4")]
    sim = cluster(nodes, preempt=True, requeue=True)
    assert sim.place(task("low", 750))
    (there,) = [i for i, pods in enumerate(sim.on_node) if pods]
    high = TracePod("high", 1000, 1024, num_gpu=1, gpu_milli=750, models=frozenset({nodes[there].model}))
    assert sim.place(high)
    expected = [[("high", "pod-2")], [("low", "pod-3")]]
    assert gpu_uids(sim) == (expected if there == 0 else expected[::-1])
    tally = sim.tally
    assert (tally.preemptions, tally.retried, tally.retried_placed, tally.evicted_pods) == (1, 1, 1, {LOW: 1})
    assert tally.placed_milli == {LOW: 750, HIGH: 750}


def test_off_places_as_the_replay_does_and_a_seed_decides_everything() -> None:
    nodes = [TraceNode(name=f"n{i}", cpu_milli=16000, memory_mib=65536, gpus=2 + i % 3, model="T4") for i in range(6)]
    rng = random.Random(3)
    pods = [
        TracePod(
            name=f"p{i}",
            cpu_milli=rng.choice([500, 2000, 4000]),
            memory_mib=1024,
            num_gpu=rng.choice([0, 1, 1, 1, 2]),
            gpu_milli=rng.choice([250, 500, 1000]),
        )
        for i in range(40)
    ]
    priorities = {p.name: rng.choice([HIGH, MIDDLE, LOW]) for p in pods}
    off = priority_replay(nodes, pods, priorities=priorities, policy="fgd", seed=42, mode="off")
    assert off.allocation == replay(nodes, pods, policy=FGD, seed=42).allocation
    assert off.evicted_pods[-1] == 0 and off.preemptions == 0
    first = priority_replay(nodes, pods, priorities=priorities, policy="fgd", seed=42, mode="evict")
    assert first == priority_replay(nodes, pods, priorities=priorities, policy="fgd", seed=42, mode="evict")
    assert first.preemptions > 0 and first.evicted_pods[-1] > 0
    assert first.classes["high"][-1] >= off.classes["high"][-1]
    assert first.evicted_by_class["high"] == 0


def test_the_script_runs_on_a_small_slice(tmp_path: Path) -> None:
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},16000,65536,2,T4\n" for i in range(4))
    )
    head = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n"
    rows = "".join(
        f"p{i},{1000 + 500 * (i % 4)},1024,1,{(250, 500, 1000)[i % 3]},,{('LS', 'BE', 'Burstable')[i % 3]}\n"
        for i in range(12)
    )
    for trace in ("default", "multigpu20"):  # the default trace's expected mix is made from multigpu20
        (tmp_path / f"openb_pod_list_{trace}.csv").write_text(head + rows)
    assert read_priorities(tmp_path / "openb_pod_list_default.csv")["p0"] == HIGH
    (tmp_path / "no-qos.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,500\n")
    with pytest.raises(ValueError, match="no qos column"):
        read_priorities(tmp_path / "no-qos.csv")
    command = [sys.executable, str(REPO / "scripts" / "bench_preemption.py"), "--data", str(tmp_path)]
    command += ["--policies", "fgd", "--seeds", "42", "--jobs", "1", "--out", str(tmp_path), "--limit", "10"]
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    written = json.loads((tmp_path / "preemption-openb.json").read_text())
    figures = written["traces"]["default"]["fgd"]
    assert set(figures) == {"off", "evict", "requeue"}
    assert set(figures["evict"]["high"]) == {str(p) for p in range(50, 131, 10)}
    assert "totalDropped" in figures["evict"]["vsOff"]
