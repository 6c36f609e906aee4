"""The memory watcher over the fake NVML library and real processes: attribution, reports and kills.

The processes are real children of the test (``sleep``), so that pidfds and SIGKILL are real; their
``/proc/<pid>/cgroup`` is a file in a directory that plays /proc, written as the kubelet and containerd would
place them. NVML lists them on a GPU with the memory the test says.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpushared import contract
from gpushared.contract import DEFAULT_RESOURCES, MemoryUnit, dra
from gpushared.core.dra.allocated import ClaimRef
from gpushared.core.dra.prepare import ClaimRead, DraNode, PreparedClaim, decide, decide_all
from gpushared.core.node.exposure import ExposurePolicy
from gpushared.core.node.memory import Enforcement, MemoryPolicy
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from gpushared.daemon.compute import EVENT_COMPUTE_OVER_LIMIT, ComputeWatcher
from gpushared.daemon.memory import EVENT_OVER_LIMIT, ClaimsView, GpuView, MemoryWatcher
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.nvml.backend import NvmlBackend
from tests.builders import inventory, pod
from tests.fakes.nvml import FakeNvml

INV = inventory(16, 12, 24, 8)


class Events:
    """The outbox, as far as the watcher uses it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []

    def event(self, body: dict[str, Any], reason: str, message: str, *, warning: bool) -> None:
        self.sent.append((body["metadata"]["name"], reason, message))


@pytest.fixture
def backend(fake_nvml: FakeNvml) -> Iterator[NvmlBackend]:
    pynvml.nvmlInit()
    yield NvmlBackend()
    pynvml.nvmlShutdown()


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for child in started:
        child.kill()
        child.wait()


def running(pod_body: dict[str, Any], container: str, container_id: str) -> None:
    pod_body["status"] = {
        "phase": "Running",
        "containerStatuses": [{"name": container, "containerID": f"containerd://{container_id}"}],
    }


def placed(name: str, gib: int, gpu: int, *, uid: str, **annotations: str) -> dict[str, Any]:
    body = pod(name, gib, node="n1", uid=uid, annotations=annotations)
    body["metadata"]["annotations"].update(
        bind_annotations(pod_request(body), [INV.gpus[gpu]], unit=INV.unit, now_ns=1)
    )
    return body


def in_container(proc: Path, pid: int, uid: str, container_id: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    slice_uid = uid.replace("-", "_")
    (proc / str(pid) / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{slice_uid}.slice/"
        f"cri-containerd-{container_id}.scope\n"
    )


def on_host(proc: Path, pid: int) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text("0::/system.slice/nvidia-mps.service\n")


UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"
ID_A, ID_B = "a" * 64, "b" * 64


def watcher(
    backend: NvmlBackend,
    fake: FakeNvml,
    pods: list[dict[str, Any]],
    proc: Path,
    events: Events,
    *,
    now: list[float],
    compute: ComputeWatcher | None = None,
) -> MemoryWatcher:
    return MemoryWatcher(
        backend=backend,
        gpus=lambda: [GpuView(i, gpu.uuid, gpu.memory_mib) for i, gpu in enumerate(fake.gpus)],
        pods=lambda: pods,
        outbox=events,  # type: ignore[arg-type]
        metrics=DaemonMetrics(),
        unit=MemoryUnit.GIB,
        resources=DEFAULT_RESOURCES,
        enforcement=Enforcement.REPORT,
        policy=MemoryPolicy(grace_seconds=10, tolerance_mib=256, reserve_mib=512),
        proc=proc,
        clock=lambda: now[0],
        compute=compute,
    )


def test_over_its_allocation_a_container_is_reported_then_killed_and_its_neighbour_untouched(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    proc = tmp_path / "proc"
    greedy = subprocess.Popen(["sleep", "60"])
    polite = subprocess.Popen(["sleep", "60"])
    mps_server = subprocess.Popen(["sleep", "60"])
    children += [greedy, polite, mps_server]
    a = placed("greedy", 2, 0, uid=UID_A, **{contract.POD_MEMORY_ENFORCEMENT: "kill"})
    b = placed("polite", 4, 0, uid=UID_B)
    running(a, "c0", ID_A)
    running(b, "c0", ID_B)
    in_container(proc, greedy.pid, UID_A, ID_A)
    in_container(proc, polite.pid, UID_B, ID_B)
    on_host(proc, mps_server.pid)
    fake_nvml.set_processes(0, (greedy.pid, 5120), (polite.pid, 4000), (mps_server.pid, 30))
    events, now = Events(), [100.0]
    watch = watcher(backend, fake_nvml, [a, b], proc, events, now=now)

    first = watch.poll()
    assert [(u.ref.pod, u.used_mib, u.allocated_mib) for u in first.usages] == [
        ("greedy", 5120, 2048),
        ("polite", 4000, 4096),
    ]
    assert first.host == {0: [(mps_server.pid, 30)]}
    assert [(name, reason) for name, reason, _ in events.sent] == [("greedy", EVENT_OVER_LIMIT)]
    assert "uses 5120 MiB of GPU 0" in events.sent[0][2] and "allocated 2048 MiB" in events.sent[0][2]
    assert greedy.poll() is None  # within the grace

    now[0] += 10
    second = watch.poll()
    assert [(k.pid, k.reason) for k in second.kills] == [(greedy.pid, "kill")]
    assert greedy.wait(timeout=5) == -9  # SIGKILL
    assert polite.poll() is None and mps_server.poll() is None
    assert "killed process" in events.sent[-1][2]
    series = {(s.pod, s.container): (s.used_bytes, s.allocated_bytes) for s in watch.series()}
    assert series[("polite", "c0")] == (4000 * 2**20, 4096 * 2**20)


def test_a_pid_that_exited_between_nvml_and_proc_is_left_out(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    fake_nvml.set_processes(1, (gone.pid, 9000))
    decision = watcher(backend, fake_nvml, [], tmp_path / "proc", Events(), now=[0.0]).poll()
    assert decision.usages == [] and decision.host == {} and decision.kills == []


def test_a_process_of_a_pod_the_node_does_not_know_is_never_killed(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    proc = tmp_path / "proc"
    stranger = subprocess.Popen(["sleep", "60"])
    children.append(stranger)
    in_container(proc, stranger.pid, UID_A, ID_A)  # its pod is not among the node's pods (yet)
    fake_nvml.set_processes(3, (stranger.pid, 8192))  # the whole GPU: past the reserve
    decision = watcher(backend, fake_nvml, [], proc, Events(), now=[0.0]).poll()
    assert decision.kills == []
    assert decision.host == {3: [(stranger.pid, 8192)]}
    assert stranger.poll() is None


def test_a_pods_new_version_is_read_again(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    """Allowances are kept per pod resourceVersion: an annotation edited since (a new version) counts."""
    proc = tmp_path / "proc"
    greedy = subprocess.Popen(["sleep", "60"])
    children.append(greedy)
    a = placed("greedy", 2, 0, uid=UID_A)
    a["metadata"]["resourceVersion"] = "1"
    running(a, "c0", ID_A)
    in_container(proc, greedy.pid, UID_A, ID_A)
    fake_nvml.set_processes(0, (greedy.pid, 5120))
    pods, now = [a], [0.0]
    watch = watcher(backend, fake_nvml, pods, proc, Events(), now=now)
    assert not watch.poll().kills
    now[0] = 60
    assert not watch.poll().kills  # report only, however long
    edited = {**a, "metadata": {**a["metadata"], "resourceVersion": "2"}}
    edited["metadata"]["annotations"] = {**a["metadata"]["annotations"], contract.POD_MEMORY_ENFORCEMENT: "kill"}
    pods[0] = edited
    now[0] = 61
    assert [k.pid for k in watch.poll().kills] == [greedy.pid]
    assert greedy.wait(timeout=5) == -9


def test_a_malformed_enforcement_is_named_on_the_pod_once_and_the_nodes_applies(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    bad = placed("typo", 2, 0, uid=UID_B, **{contract.POD_MEMORY_ENFORCEMENT: "evict"})
    bad["metadata"]["resourceVersion"] = "7"
    events = Events()
    watch = watcher(backend, fake_nvml, [bad], tmp_path / "proc", events, now=[0.0])
    watch.poll()
    watch.poll()
    assert [(name, reason) for name, reason, _ in events.sent] == [("typo", "GPUMemoryEnforcementInvalid")]
    assert "must be one of off, report, kill (got 'evict'); the node's report applies" in events.sent[0][2]


def test_the_kubelets_devices_are_the_allowance_and_its_absence_falls_back_to_the_annotations(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    from gpushared.kubelet.podresources.client import PodDevices, PodResourcesUnavailable

    proc = tmp_path / "proc"
    worker = subprocess.Popen(["sleep", "60"])
    children.append(worker)
    a = placed("edited", 2, 0, uid=UID_A)  # the annotations say 2 GiB; the kubelet gave it 4
    running(a, "c0", ID_A)
    in_container(proc, worker.pid, UID_A, ID_A)
    fake_nvml.set_processes(0, (worker.pid, 3000))
    listing: list[object] = [PodDevices("default", "edited", {"c0": ["0-0", "0-1", "0-2", "0-3"]})]

    def pod_devices() -> list[object]:
        if not listing:
            raise PodResourcesUnavailable("StatusCode.UNAVAILABLE")
        return listing

    events = Events()
    watch = watcher(backend, fake_nvml, [a], proc, events, now=[0.0])
    watch.pod_devices = pod_devices  # type: ignore[assignment]
    [usage] = watch.poll().usages
    assert (usage.used_mib, usage.allocated_mib) == (3000, 4096)
    assert not events.sent
    listing.clear()  # the kubelet does not answer: what the annotations say
    [usage] = watch.poll().usages
    assert usage.allocated_mib == 2048
    assert [reason for _, reason, _ in events.sent] == [EVENT_OVER_LIMIT]


def test_sm_use_is_measured_per_container_and_use_over_the_compute_limit_reported_once(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    """Compute shares without MPS (issue #43): NVML's per-process SM samples, summed per container, against
    the pod's compute limit. Over it (beyond the tolerance) is one Event per episode and a counter; nothing
    is killed; a pod without a limit is measured and never reported."""
    proc = tmp_path / "proc"
    greedy, second, quiet = (subprocess.Popen(["sleep", "60"]) for _ in range(3))
    children += [greedy, second, quiet]
    a = placed("capped", 2, 0, uid=UID_A, **{contract.POD_COMPUTE_REQUEST: "20", contract.POD_COMPUTE_LIMIT: "40"})
    b = placed("free", 2, 0, uid=UID_B)
    running(a, "c0", ID_A)
    running(b, "c0", ID_B)
    in_container(proc, greedy.pid, UID_A, ID_A)
    in_container(proc, second.pid, UID_A, ID_A)  # two processes of one container: their use is summed
    in_container(proc, quiet.pid, UID_B, ID_B)
    fake_nvml.set_processes(0, (greedy.pid, 100), (second.pid, 100), (quiet.pid, 100))
    fake_nvml.set_sm_util(0, **{str(greedy.pid): 30, str(second.pid): 20, str(quiet.pid): 70})
    events, metrics = Events(), DaemonMetrics()
    compute = ComputeWatcher(backend=backend, outbox=events, metrics=metrics)  # type: ignore[arg-type]
    watch = watcher(backend, fake_nvml, [a, b], proc, events, now=[0.0], compute=compute)

    watch.poll()
    assert [(u.ref.pod, u.gpu, u.sm_percent, u.limit) for u in compute.last.uses] == [
        ("capped", 0, 50, 40),
        ("free", 0, 70, None),
    ]
    assert [(name, reason) for name, reason, _ in events.sent] == [("capped", EVENT_COMPUTE_OVER_LIMIT)]
    assert "used 50% of GPU 0's SMs, over its pod's compute limit of 40%" in events.sent[0][2]
    watch.poll()  # still over: the same episode, no second Event
    assert len(events.sent) == 1
    fake_nvml.set_sm_util(0, **{str(greedy.pid): 20, str(second.pid): 20, str(quiet.pid): 70})
    watch.poll()  # 40 %: within its limit, the episode ends
    fake_nvml.set_sm_util(0, **{str(greedy.pid): 40, str(second.pid): 20})
    watch.poll()  # over again: a new episode
    assert [name for name, _, _ in events.sent] == ["capped", "capped"]
    assert greedy.poll() is None and second.poll() is None  # measured and said, never killed
    samples = {
        (s.name, s.labels["pod"]): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name.startswith("gpushared_container_gpu_compute")
    }
    assert samples[("gpushared_container_gpu_compute_used_ratio", "capped")] == 0.6
    assert samples[("gpushared_container_gpu_compute_limit_ratio", "capped")] == 0.4
    assert ("gpushared_container_gpu_compute_limit_ratio", "free") not in samples
    assert metrics.compute_overruns._value.get() == 2


def test_a_dra_pods_containers_may_use_what_their_claims_hold(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    """DRA mode: a container that uses a claim prepared on the node is judged against the claim's memory on
    its GPU, not as a container that asked for none; a claim prepared later is seen at the next poll."""
    proc = tmp_path / "proc"
    worker = subprocess.Popen(["sleep", "60"])
    children.append(worker)
    body = pod("trainer", 0, node="n1", uid=UID_A)
    body["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu-3gi"}]
    body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    running(body, body["spec"]["containers"][0]["name"], ID_A)
    body["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": "trainer-gpu-x7k2"}]
    in_container(proc, worker.pid, UID_A, ID_A)
    fake_nvml.set_processes(1, (worker.pid, 3000))
    inventory = contract.GpuInventory(
        unit=MemoryUnit.GIB,
        gpus=tuple(
            contract.GpuInfo(i, g.uuid, "m", g.memory_mib // 1024, g.memory_mib) for i, g in enumerate(fake_nvml.gpus)
        ),
    )
    ref = ClaimRef("default", "trainer-gpu-x7k2", "claim-uid")
    result = {
        "request": "gpu",
        "driver": dra.DRIVER,
        "pool": "n1",
        "device": dra.device_name(fake_nvml.gpus[1].uuid),
        "consumedCapacity": {"memory": "3Gi"},
    }
    claim = {"metadata": {"uid": "claim-uid"}, "status": {"allocation": {"devices": {"results": [result]}}}}
    prepared = decide(ref, claim, DraNode(name="n1", inventory=inventory, exposure=ExposurePolicy(device_nodes=False)))
    assert isinstance(prepared, PreparedClaim)
    book: dict[tuple[str, str], PreparedClaim] = {}
    version = [0]
    events, now = Events(), [100.0]
    watch = watcher(backend, fake_nvml, [body], proc, events, now=now)
    watch.claims = ClaimsView(claims=lambda: dict(book), version=lambda: version[0])

    before = watch.poll()
    assert [(u.ref.pod, u.used_mib, u.allocated_mib) for u in before.usages] == [("trainer", 3000, 0)]
    book[(ref.namespace, ref.name)] = prepared
    version[0] += 1
    after = watch.poll()
    assert [(u.ref.pod, u.gpu, u.used_mib, u.allocated_mib) for u in after.usages] == [("trainer", 1, 3000, 3072)]


def test_a_running_pod_combining_prepared_claims_otherwise_than_their_specs_is_named_once(
    backend: NvmlBackend, fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """The kubelet prepares a claim once per node: a pod reserved later, with no claim left to prepare, never
    reaches the driver. Its container that uses claim a alone, where a's spec was written for containers
    given a and b, would be told b's GPU too: the watcher says so on the pod, once."""
    inventory = contract.GpuInventory(
        unit=MemoryUnit.GIB,
        gpus=tuple(
            contract.GpuInfo(i, g.uuid, "m", g.memory_mib // 1024, g.memory_mib) for i, g in enumerate(fake_nvml.gpus)
        ),
    )
    node = DraNode(name="n1", inventory=inventory, exposure=ExposurePolicy(device_nodes=False))
    refs = [ClaimRef("default", name, f"uid-{name}") for name in ("a", "b")]

    def claim_on(ref: ClaimRef, gpu: int) -> dict[str, Any]:
        device = {
            "request": "gpu",
            "driver": dra.DRIVER,
            "pool": "n1",
            "device": dra.device_name(fake_nvml.gpus[gpu].uuid),
        }
        return {"metadata": {"uid": ref.uid}, "status": {"allocation": {"devices": {"results": [device]}}}}

    def using(name: str, uid: str, *claims: str) -> dict[str, Any]:
        body = pod(name, 0, node="n1", uid=uid)
        body["metadata"]["resourceVersion"] = "3"
        body["spec"]["resourceClaims"] = [{"name": c, "resourceClaimName": c} for c in claims]
        body["spec"]["containers"][0]["resources"] = {"claims": [{"name": c} for c in claims]}
        running(body, body["spec"]["containers"][0]["name"], ID_A)
        return body

    first = using("first", UID_A, "a", "b")
    reads = [ClaimRead(ref, claim_on(ref, gpu), [first]) for ref, gpu in zip(refs, (0, 1), strict=True)]
    book = {("default", uid.removeprefix("uid-")): c for uid, c in decide_all(reads, node).items()}
    assert all(isinstance(c, PreparedClaim) for c in book.values())
    later = using("later", UID_B, "a")
    events = Events()
    watch = watcher(backend, fake_nvml, [first, later], tmp_path / "proc", events, now=[0.0])
    watch.claims = ClaimsView(claims=lambda: dict(book), version=lambda: 1)  # type: ignore[arg-type]
    watch.poll()
    watch.poll()
    assert [(name, reason) for name, reason, _ in events.sent] == [("later", "DRAClaimsCombinedOtherwise")]
    assert "may be told other GPUs than their claims hold" in events.sent[0][2]
    assert (
        "was prepared for containers that use claims default/a (request gpu), default/b (request gpu)"
        in (events.sent[0][2])
    )
