"""What the daemon does about GPU memory used past a pod's allocation: the decision, as tables and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared import contract
from gpushared.contract import DEFAULT_RESOURCES, MemoryUnit
from gpushared.core.node.cgroups import CgroupOwner
from gpushared.core.node.memory import (
    Allowance,
    ContainerRef,
    Enforcement,
    Episode,
    GpuProcess,
    MemoryPolicy,
    allowances_of,
    decide_memory,
    given_by_kubelet,
    owner_ref,
    pod_enforcement,
)
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from tests.builders import inventory, pod

A = ContainerRef("uid-a", "default", "a", "main")
B = ContainerRef("uid-b", "default", "b", "main")
GPU_MIB = {0: 16384, 1: 16384}
POLICY = MemoryPolicy(grace_seconds=10, tolerance_mib=256, reserve_mib=512)


def allow(mib: int, enforcement: Enforcement = Enforcement.REPORT, *, gpu: int = 0, mps: bool = False) -> Allowance:
    return Allowance(allocated_mib={gpu: mib}, enforcement=enforcement, mps=mps)


@pytest.mark.parametrize(
    ("node", "annotation", "expected"),
    [
        (Enforcement.REPORT, None, Enforcement.REPORT),
        (Enforcement.REPORT, "kill", Enforcement.KILL),
        (Enforcement.KILL, "off", Enforcement.KILL),  # a pod cannot loosen its node's
        (Enforcement.OFF, "Report", Enforcement.REPORT),
        (Enforcement.REPORT, "evict", Enforcement.REPORT),  # malformed: the node's
    ],
)
def test_a_pod_can_only_make_its_enforcement_stricter(
    node: Enforcement, annotation: str | None, expected: Enforcement
) -> None:
    assert pod_enforcement(node, annotation) is expected


def test_a_malformed_setting_names_the_key() -> None:
    with pytest.raises(contract.ContractError, match=r"memory-enforcement.*off, report, kill"):
        Enforcement.parse("evict")


def test_usage_per_container_per_gpu_and_host_processes_apart() -> None:
    decision = decide_memory(
        [
            GpuProcess(10, 0, 1000, A),
            GpuProcess(11, 0, 500, A),
            GpuProcess(12, 1, 300, A),
            GpuProcess(20, 0, 700, None),  # an MPS server, a host job
        ],
        {("uid-a", "main"): Allowance({0: 2048, 1: 1024}, Enforcement.REPORT)},
        gpu_mib=GPU_MIB,
        policy=POLICY,
        episodes={},
        now=0,
    )
    assert [(u.gpu, u.used_mib, u.allocated_mib, u.pids) for u in decision.usages] == [
        (0, 1500, 2048, (10, 11)),
        (1, 300, 1024, (12,)),
    ]
    assert decision.host == {0: [(20, 700)]}
    assert not decision.reports
    assert not decision.kills


def test_report_once_per_episode_and_again_after_it_ends() -> None:
    over = [GpuProcess(10, 0, 5000, A)]
    allowances = {("uid-a", "main"): allow(2048)}
    first = decide_memory(over, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes={}, now=0)
    assert [(r.usage.used_mib, r.usage.allocated_mib) for r in first.reports] == [(5000, 2048)]
    again = decide_memory(over, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes=first.episodes, now=30)
    assert not again.reports
    assert not again.kills  # report only
    within = decide_memory(
        [GpuProcess(10, 0, 2000, A)], allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes=again.episodes, now=31
    )
    assert within.episodes == {}
    later = decide_memory(over, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes=within.episodes, now=40)
    assert len(later.reports) == 1


def test_the_tolerance_covers_the_cuda_context() -> None:
    decision = decide_memory(
        [GpuProcess(10, 0, 2048 + 256, A)],
        {("uid-a", "main"): allow(2048, Enforcement.KILL)},
        gpu_mib=GPU_MIB,
        policy=POLICY,
        episodes={("uid-a", "main", 0): Episode(since=-100)},
        now=0,
    )
    assert not decision.reports
    assert not decision.kills


def test_kill_after_the_grace_the_largest_processes_until_within() -> None:
    processes = [GpuProcess(10, 0, 3000, A), GpuProcess(11, 0, 200, A), GpuProcess(12, 0, 1500, A)]
    allowances = {("uid-a", "main"): allow(2048, Enforcement.KILL)}
    early = decide_memory(processes, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes={}, now=0)
    assert len(early.reports) == 1
    assert not early.kills  # within the grace
    late = decide_memory(processes, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes=early.episodes, now=10)
    assert [(k.pid, k.used_mib, k.reason) for k in late.kills] == [(10, 3000, "kill")]  # 1700 left: within


def test_a_neighbour_within_its_allocation_is_never_touched() -> None:
    processes = [GpuProcess(10, 0, 9000, A), GpuProcess(20, 0, 4000, B)]
    allowances = {("uid-a", "main"): allow(2048, Enforcement.KILL), ("uid-b", "main"): allow(4096, Enforcement.KILL)}
    decision = decide_memory(
        processes, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes={("uid-a", "main", 0): Episode(0)}, now=60
    )
    assert [k.pid for k in decision.kills] == [10]


def test_under_pressure_the_most_over_goes_first_even_under_report() -> None:
    # GPU 0: 16384 MiB, reserve 512: the line is 15872. A is 6000 over, B 2000 over, C within.
    c = ContainerRef("uid-c", "default", "c", "main")
    processes = [GpuProcess(10, 0, 8048, A), GpuProcess(20, 0, 4048, B), GpuProcess(30, 0, 4000, c)]
    allowances = {
        ("uid-a", "main"): allow(2048),
        ("uid-b", "main"): allow(2048),
        ("uid-c", "main"): allow(4096),
    }
    decision = decide_memory(processes, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes={}, now=0)
    assert [(k.pid, k.reason) for k in decision.kills] == [(10, "pressure")]  # 8048 left: under the line


def test_under_pressure_off_mps_and_host_processes_are_spared() -> None:
    m = ContainerRef("uid-m", "default", "m", "main")
    processes = [GpuProcess(10, 0, 8000, A), GpuProcess(20, 0, 6000, m), GpuProcess(30, 0, 3000, None)]
    allowances = {("uid-a", "main"): allow(1024, Enforcement.OFF), ("uid-m", "main"): allow(1024, mps=True)}
    decision = decide_memory(processes, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes={}, now=0)
    assert not decision.kills
    assert [r.usage.ref for r in decision.reports] == [m]  # an MPS pod is reported, not killed


def test_a_pod_that_asked_for_no_gpu_memory_is_over_everything_it_uses() -> None:
    decision = decide_memory([GpuProcess(10, 1, 4000, A)], {}, gpu_mib=GPU_MIB, policy=POLICY, episodes={}, now=0)
    assert [(r.usage.allocated_mib, r.enforcement) for r in decision.reports] == [(0, Enforcement.REPORT)]


def test_killing_a_process_on_two_gpus_frees_both() -> None:
    processes = [GpuProcess(10, 0, 16000, A), GpuProcess(10, 1, 15000, A), GpuProcess(20, 1, 1000, B)]
    allowances = {("uid-a", "main"): Allowance({0: 1024, 1: 1024}, Enforcement.REPORT)}
    decision = decide_memory(processes, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes={}, now=0)
    assert [(k.pid, k.usage.gpu) for k in decision.kills] == [(10, 0)]  # one kill: GPU 1 is under the line then


# --- properties ---------------------------------------------------------------------------------------------

CONTAINERS = [ContainerRef(f"uid-{i}", "ns", f"p{i}", "c") for i in range(4)]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[GpuProcess], dict[tuple[str, str], Allowance], dict]:
    processes = []
    for pid in range(1, draw(st.integers(0, 12)) + 1):
        owner = draw(st.sampled_from([None, *CONTAINERS]))
        for gpu in draw(st.sets(st.integers(0, 1), min_size=1, max_size=2)):
            processes.append(GpuProcess(pid, gpu, draw(st.integers(0, 12000)), owner))
    allowances = {}
    for ref in CONTAINERS:
        if draw(st.booleans()):
            allowances[(ref.uid, ref.container)] = Allowance(
                {gpu: draw(st.integers(0, 16384)) for gpu in (0, 1)},
                draw(st.sampled_from(list(Enforcement))),
                mps=draw(st.booleans()),
            )
    episodes = {
        (ref.uid, ref.container, gpu): Episode(since=draw(st.floats(-100, 0)))
        for ref in CONTAINERS
        for gpu in (0, 1)
        if draw(st.booleans())
    }
    return processes, allowances, episodes


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_only_processes_of_containers_over_their_allocation_are_ever_killed(
    world: tuple[list[GpuProcess], dict[tuple[str, str], Allowance], dict],
) -> None:
    processes, allowances, episodes = world
    decision = decide_memory(processes, allowances, gpu_mib=GPU_MIB, policy=POLICY, episodes=episodes, now=0)
    owners = {p.pid: p.owner for p in processes}
    for kill in decision.kills:
        assert owners[kill.pid] is not None, "a process of no pod"
        assert kill.usage.ref == owners[kill.pid], "a process of another container"
        used = sum(p.used_mib for p in processes if p.owner == kill.usage.ref and p.gpu == kill.usage.gpu)
        assert used > kill.usage.allocated_mib + POLICY.tolerance_mib, "a container within its allocation"
        allowance = allowances.get((kill.usage.ref.uid, kill.usage.ref.container))
        assert allowance is None or (allowance.enforcement is not Enforcement.OFF and not allowance.mps)
    assert len({k.pid for k in decision.kills}) == len(decision.kills), "a process killed twice"
    for position, kill in enumerate(decision.kills):  # each kill was needed, after the kills before it
        ref, gpu = kill.usage.ref, kill.usage.gpu
        others = {k.pid for k in decision.kills[:position]}
        before = sum(p.used_mib for p in processes if p.owner == ref and p.gpu == gpu and p.pid not in others)
        assert before > kill.usage.allocated_mib + POLICY.tolerance_mib
        assert kill.used_mib > 0


# --- from the node's pods: allowances and owners ------------------------------------------------------------


def test_allowances_from_the_recorded_choice_and_the_pods_annotation() -> None:
    inv = inventory(16, 16)
    body = pod("p", 2, 3, node="n1", annotations={contract.POD_MEMORY_ENFORCEMENT: "kill"})
    body["spec"]["containers"].append({"name": "sidecar", "image": "busybox"})
    body["metadata"]["annotations"].update(bind_annotations(pod_request(body), [inv.gpus[1]], unit=inv.unit, now_ns=1))
    allowances = allowances_of(
        body, unit=MemoryUnit.GIB, resources=DEFAULT_RESOURCES, node=Enforcement.REPORT, gpus=[0, 1]
    )
    uid = body["metadata"]["uid"]
    assert allowances == {
        (uid, "c0"): Allowance({1: 2048}, Enforcement.KILL),
        (uid, "c1"): Allowance({1: 3072}, Enforcement.KILL),
        (uid, "sidecar"): Allowance({}, Enforcement.KILL),  # asks for none: may use none
    }


def test_a_record_that_cannot_be_read_allows_the_request_on_any_gpu() -> None:
    body = pod("bad", 4, node="n1", annotations={contract.POD_ALLOCATION: "{"})
    allowances = allowances_of(
        body, unit=MemoryUnit.GIB, resources=DEFAULT_RESOURCES, node=Enforcement.KILL, gpus=[0, 1]
    )
    assert allowances == {(body["metadata"]["uid"], "c0"): Allowance({0: 4096, 1: 4096}, Enforcement.KILL)}


def test_an_mps_pods_containers_are_marked() -> None:
    inv = inventory(16, mps=True)
    body = pod("m", 2, node="n1", annotations={contract.POD_MPS: "true"})
    body["metadata"]["annotations"].update(bind_annotations(pod_request(body), [inv.gpus[0]], unit=inv.unit, now_ns=1))
    (allowance,) = allowances_of(
        body, unit=MemoryUnit.GIB, resources=DEFAULT_RESOURCES, node=Enforcement.REPORT, gpus=[0]
    ).values()
    assert allowance.mps


def test_a_process_is_named_by_its_pods_container_status() -> None:
    body = pod("p", 2, node="n1", uid="3f2a9c1e-7b4d-4e8f-9a0b-1c2d3e4f5a6b")
    body["status"]["containerStatuses"] = [{"name": "c0", "containerID": "containerd://" + "ab" * 32}]
    pods = {body["metadata"]["uid"]: body}
    assert owner_ref(CgroupOwner(body["metadata"]["uid"], "ab" * 32), pods) == ContainerRef(
        body["metadata"]["uid"], "default", "p", "c0"
    )
    assert owner_ref(CgroupOwner(body["metadata"]["uid"], "cd" * 32), pods) is None  # not in its status yet
    assert owner_ref(CgroupOwner("0" * 8 + "-0000-0000-0000-" + "0" * 12, "ab" * 32), pods) is None  # unknown pod
    assert owner_ref(CgroupOwner(body["metadata"]["uid"], None), pods) is None  # CRI-O's conmon
    assert owner_ref(None, pods) is None  # a host process


def test_what_the_kubelet_gave_a_container_is_its_allowance() -> None:
    allowances = {("u", "main"): Allowance({1: 2048}, Enforcement.KILL), ("u", "side"): Allowance({}, Enforcement.KILL)}
    given = given_by_kubelet(
        allowances, "u", {"main": ["0-0", "0-1", "0-2", "3-0"], "side": [], "other": ["0-3"]}, unit=MemoryUnit.GIB
    )
    assert given == {("u", "main"): Allowance({0: 3072, 3: 1024}, Enforcement.KILL)}
