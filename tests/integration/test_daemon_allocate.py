"""The node daemon's Allocate over real sockets: the GPU each container gets and the refusals."""

from __future__ import annotations

import random
import time

import pytest

from gpushared import contract
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from tests.builders import pod
from tests.fakes.apiserver import Fault
from tests.fakes.kubelet import AdmissionError
from tests.harness import GPU_MEM, NODE, TOTAL_UNITS, Daemon, started, uuids, wait_until


def test_allocate_answers_unavailable_within_its_budget_when_the_api_server_hangs(daemon: Daemon) -> None:
    """Defect: with a hanging API server, GetPreferredAllocation and Allocate each took 40 s (10 s x urllib3's
    retries) while the kubelet, admitting one pod at a time, admitted nothing else."""
    started(daemon)
    daemon.api.stall_watches()  # the daemon's pod watch never shows the pod: it must read it
    daemon.api.inject(Fault(method="GET", path=r"/pods/slow$", delay=30.0, times=None))
    body = daemon.place("slow", 4, gpu=1)
    began = time.monotonic()
    with pytest.raises(AdmissionError, match=r"UNAVAILABLE: cannot read pod default/slow to find its GPU"):
        daemon.admit(body)
    assert time.monotonic() - began < 6.0  # 2 s for GetPreferredAllocation, 2 s for Allocate, and slack
    reads = [r for r in daemon.api.requests if r.method == "GET" and r.path.endswith("/pods/slow")]
    assert len(reads) <= 2  # once each: no retries


def test_a_gpu_choice_edited_after_allocate_keeps_the_gpu_the_kubelet_gave(daemon: Daemon) -> None:
    """Defect: a pod owner patching its annotations to another GPU (or to 0) moved the daemon's books, and
    Allocate then let other pods onto the GPU it still used."""
    from kubernetes import client

    started(daemon)
    body = daemon.place("tenant", 10, gpu=1)  # GPU 1: 12 GiB
    daemon.admit(body)
    forged = bind_annotations(pod_request(body), [daemon.inventory().gpus[0]], unit=contract.MemoryUnit.GIB, now_ns=1)
    forged[contract.ALIYUN_GPU_MEM_POD] = "0"
    core = client.CoreV1Api(daemon.api.client())
    core.patch_namespaced_pod("tenant", "default", {"metadata": {"annotations": forged}})

    def tenant() -> dict[str, object]:
        return next(p for p in daemon.status()["pods"] if p["name"] == "tenant")

    wait_until(
        lambda: daemon.events("tenant") and ("GPUAllocationEdited" in dict(daemon.events("tenant"))), message="event"
    )
    assert tenant()["gpus"] == {"1": 10}
    # 2 GiB are left on GPU 1: a 4 GiB pod placed there is refused, as it would have been before the edit.
    other = daemon.place("neighbour", 4, gpu=1)
    with pytest.raises(AdmissionError, match="would bring GPU 1 to 14 GiB of 12 GiB"):
        daemon.admit(other)
    assert "gpushared_allocation_edits_total 1.0" in daemon.metrics_text()


def test_a_poisoned_pod_is_counted_at_its_spec_and_the_daemon_keeps_serving(daemon: Daemon) -> None:
    """Defect (issue #39): a pod whose ALIYUN_COM_GPU_MEM_IDX held a 5,000-digit integer (even one asking for
    no GPU, created with spec.nodeName set) made the daemon exit with status 1 within 2 s, on every restart."""
    started(daemon)
    for name, amount, key in (
        ("poison-idx", 0, contract.ALIYUN_GPU_MEM_IDX),
        ("poison-alloc", 4, contract.POD_ALLOCATION),
        ("poison-mps", 4, contract.POD_MPS_THREAD_PERCENTAGE),
    ):
        body = pod(name, *([amount] if amount else []), node=NODE)
        body["metadata"]["annotations"][key] = (
            '{"version":1,"unit":"GiB","containers":[{"name":"c0","gpus":[{"index":' + "1" * 5000 + "}]}]}"
            if key == contract.POD_ALLOCATION
            else "9" * 5000
        )
        daemon.api.create(body)
    wait_until(lambda: any(r == "GPUAnnotationUnreadable" for r, _ in daemon.events("poison-alloc")), message="event")
    daemon.turns(10)  # the crash came within 2 s: ten turns of the loop, each reading every pod
    assert daemon.process is not None and daemon.process.poll() is None
    pods = {p["name"]: p for p in daemon.status()["pods"]}
    assert pods["poison-alloc"]["pending"] == 4 and pods["poison-mps"]["pending"] == 4
    assert "gpushared_unreadable_pods_total 3.0" in daemon.metrics_text()
    # Allocate goes on: a well-formed pod on GPU 3 (8 GiB) gets its GPU.
    (allocation,) = daemon.admit(daemon.place("fine", 4, gpu=3))
    assert allocation.response.envs["NVIDIA_VISIBLE_DEVICES"] == daemon.nvml.gpus[3].uuid


def test_allocate_a_single_container_pod(daemon: Daemon) -> None:
    started(daemon)
    body = daemon.place("one", 4, gpu=1)
    (allocation,) = daemon.admit(body)
    gpu = daemon.nvml.gpus[1]
    assert allocation.response.envs == {
        "NVIDIA_VISIBLE_DEVICES": gpu.uuid,
        "ALIYUN_COM_GPU_MEM_IDX": "1",
        "ALIYUN_COM_GPU_MEM_POD": "4",
        "ALIYUN_COM_GPU_MEM_CONTAINER": "4",
        "ALIYUN_COM_GPU_MEM_DEV": "12",
    }
    assert all(d.startswith("1-") for d in allocation.device_ids)
    pod = wait_until(
        lambda: (
            (p := daemon.api.get("pods", "one", "default"))
            and p["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_ASSIGNED] == "true"
            and p
        ),
        message="ASSIGNED=true",
    )
    assert int(pod["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_ASSUME_TIME]) > 0
    wait_until(lambda: ("GPUAllocated", "GPU memory allocated: c0 on GPU 1") in daemon.events("one"), message="event")


def test_allocate_a_container_on_several_gpus(daemon: Daemon) -> None:
    """gpu-count 2 and 16 GiB: 8 GiB on each of the two GPUs the extender chose, both visible to the container,
    and the kubelet's devices taken from each in the same shares."""
    started(daemon)
    body = daemon.place("train", 16, gpu=[2, 0])
    (allocation,) = daemon.admit(body)
    gpus = daemon.nvml.gpus
    assert allocation.response.envs == {
        "NVIDIA_VISIBLE_DEVICES": f"{gpus[2].uuid},{gpus[0].uuid}",
        "ALIYUN_COM_GPU_MEM_IDX": "2,0",
        "ALIYUN_COM_GPU_MEM_POD": "16",
        "ALIYUN_COM_GPU_MEM_CONTAINER": "16",
        "ALIYUN_COM_GPU_MEM_DEV": "24",
    }
    assert sorted(d.split("-")[0] for d in allocation.device_ids) == ["0"] * 8 + ["2"] * 8
    wait_until(
        lambda: ("GPUAllocated", "GPU memory allocated: c0 on GPUs 2, 0") in daemon.events("train"), message="event"
    )
    pods = {p["name"]: p for p in daemon.status()["pods"]}
    assert pods["train"]["gpus"] == {"0": 8, "2": 8} and pods["train"]["containers"] == {"c0": [2, 0]}


def test_allocate_a_multi_container_pod_with_an_init_container(daemon: Daemon) -> None:
    started(daemon)
    init = [{"name": "warm", "image": "busybox", "resources": {"limits": {GPU_MEM: "5"}}}]
    body = daemon.place("multi", 3, 2, gpu=2, init=init)
    allocations = daemon.admit(body)
    assert [a.name for a in allocations] == ["warm", "c0", "c1"]
    assert set(uuids(allocations)) == {daemon.nvml.gpus[2].uuid}
    assert [a.response.envs["ALIYUN_COM_GPU_MEM_CONTAINER"] for a in allocations] == ["5", "3", "2"]
    wait_until(
        lambda: (
            daemon.api.get("pods", "multi", "default")["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_ASSIGNED]  # type: ignore[index]
            == "true"
        ),
        message="ASSIGNED after the last container",
    )


def test_a_daemon_restart_between_a_sidecar_and_its_app_container(daemon: Daemon) -> None:
    """Kubelet >= 1.29 lists sidecars with their devices. A daemon restarted after the sidecar's Allocate
    has forgotten that it served it: what the kubelet lists must say the sidecar is done, or the app
    container's call is taken for the sidecar's (3 GiB asked where 2 were placed: refused)."""
    daemon.kubelet.lists_sidecars = True
    started(daemon)
    init = [{"name": "proxy", "image": "busybox", "restartPolicy": "Always", "resources": {"limits": {GPU_MEM: "3"}}}]
    body = daemon.place("sidecar", 2, gpu=1, init=init)

    def restart(container: str) -> None:
        if container == "proxy":
            registrations = len(daemon.kubelet.registrations)
            assert daemon.stop() == 0
            started(daemon)
            wait_until(lambda: len(daemon.kubelet.registrations) > registrations, message="registered again")

    allocations = daemon.admit(body, between=restart)
    assert [a.name for a in allocations] == ["proxy", "c0"]
    assert set(uuids(allocations)) == {daemon.nvml.gpus[1].uuid}
    assert [a.response.envs["ALIYUN_COM_GPU_MEM_CONTAINER"] for a in allocations] == ["3", "2"]


def test_equal_pods_admitted_in_any_order_each_get_the_gpu_their_annotation_names(daemon: Daemon) -> None:
    """Aliyun's failure: equal requests bound at once and admitted out of order swap GPUs."""
    started(daemon)
    bodies = [daemon.place(f"eq-{i}", 2, gpu=i % 4) for i in range(8)]
    order = list(range(8))
    random.Random(42).shuffle(order)
    for i in order:
        (allocation,) = daemon.admit(bodies[i])
        assert allocation.response.envs["NVIDIA_VISIBLE_DEVICES"] == daemon.nvml.gpus[i % 4].uuid, f"eq-{i}"
        assert allocation.response.envs["ALIYUN_COM_GPU_MEM_IDX"] == str(i % 4)
        assert {d.split("-")[0] for d in allocation.device_ids} == {str(i % 4)}
    wait_until(
        lambda: all(
            daemon.api.get("pods", f"eq-{i}", "default")["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_ASSIGNED]  # type: ignore[index]
            == "true"
            for i in range(8)
        ),
        message="all assigned",
    )
    status = daemon.status()
    assert [g["used"] for g in status["gpus"]] == [4, 4, 4, 4]


def test_a_pod_the_extender_did_not_place_gets_an_error_and_an_event(daemon: Daemon) -> None:
    started(daemon)
    body = daemon.unplaced("rogue", 3)
    with pytest.raises(AdmissionError) as info:
        daemon.admit(body)
    message = str(info.value)
    assert "FAILED_PRECONDITION" in message
    assert "pod default/rogue cannot get 3 GiB of GPU memory" in message
    assert "not scheduled through gpushared-extender" in message
    assert "no-gpu-has" not in message
    wait_until(
        lambda: any(r == "GPUAllocationFailed" and "gpushared-extender" in m for r, m in daemon.events("rogue")),
        message="event",
    )


def test_a_pod_that_does_not_fit_its_gpu_is_refused(daemon: Daemon) -> None:
    started(daemon)
    first = daemon.place("big", 6, gpu=3)
    daemon.admit(first)
    second = daemon.place("too-much", 4, gpu=3)  # GPU 3 has 8 GiB; 6 are taken
    with pytest.raises(AdmissionError, match=r"would bring GPU 3 to 10 GiB of 8 GiB: it does not fit"):
        daemon.admit(second)
    wait_until(lambda: any("does not fit" in m for _, m in daemon.events("too-much")), message="event")


def test_a_gpu_that_changed_since_scheduling_is_refused(daemon: Daemon) -> None:
    started(daemon)
    body = daemon.place("moved", 2, gpu=0)
    daemon.nvml.gpus[0].uuid = "GPU-replaced-0000"
    daemon.nvml.write()
    wait_until(lambda: daemon.inventory().gpus[0].uuid == "GPU-replaced-0000", message="inventory follows")
    with pytest.raises(AdmissionError, match="the GPUs changed since it was scheduled"):
        daemon.admit(body)


def test_pod_lookups_are_scoped_to_the_node(daemon: Daemon) -> None:
    started(daemon)
    daemon.admit(daemon.place("scoped", 1, gpu=0))
    pod_lists = [r for r in daemon.api.requests if r.method == "GET" and r.path.endswith("/pods")]
    assert pod_lists
    assert all(r.query.get("fieldSelector") == f"spec.nodeName={NODE}" for r in pod_lists)


def test_api_server_down_at_start_and_during_allocate(daemon: Daemon) -> None:
    outage = daemon.api.inject(Fault(status=503, times=None, message="etcd is down"))
    daemon.start()
    daemon.notify.wait_for("READY=1")  # the kubelet side does not need the API server
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS)
    daemon.api.faults.remove(outage)
    wait_until(
        lambda: contract.NODE_INVENTORY in daemon.api.get("nodes", NODE)["metadata"].get("annotations", {}),
        message="inventory after outage",
    )  # type: ignore[index]
    known = daemon.place("known", 2, gpu=0)
    wait_until(lambda: any(p["name"] == "known" for p in daemon.status()["pods"]), message="watch sees the pod")
    outage = daemon.api.inject(Fault(status=503, times=None, message="etcd is down again"))
    daemon.api.cut_watches()  # the daemon's watch breaks and cannot come back while the outage lasts
    (allocation,) = daemon.admit(known)  # from the watch cache: no API call needed
    assert allocation.response.envs["NVIDIA_VISIBLE_DEVICES"] == daemon.nvml.gpus[0].uuid
    unseen = daemon.place("unseen", 1, gpu=1)  # bound during the outage: the daemon never saw it
    with pytest.raises(AdmissionError) as info:
        daemon.admit(unseen)
    assert "UNAVAILABLE" in str(info.value)
    assert "cannot read pod default/unseen to find its GPU" in str(info.value)
    daemon.api.faults.remove(outage)
    wait_until(
        lambda: (
            daemon.api.get("pods", "known", "default")["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_ASSIGNED]  # type: ignore[index]
            == "true"
        ),
        timeout=20,
        message="ASSIGNED lands after the outage",
    )


def test_cdi_cri_and_device_nodes_reach_the_kubelet(daemon: Daemon) -> None:
    """cdi-cri: the CDI names in ContainerAllocateResponse.cdi_devices (field 5, kubelet >= 1.28) and no
    variable for a hook; deviceNodes: /dev/nvidia<minor> of the pod's GPUs and the control devices the dev root
    has, as device specs. The protocol level: kubelet 1.20 and containerd 1.6 predate CDI (docs/install.md)."""
    dev = daemon.workdir / "dev-cdi"
    (dev / "dev").mkdir(parents=True)
    for name in ("nvidia0", "nvidia7", "nvidiactl", "nvidia-uvm"):  # no nvidia-uvm-tools or nvidia-modeset here
        (dev / "dev" / name).touch()
    daemon.nvml.gpus[2].minor = 7  # minors need not follow indices (NVML says which is which)
    daemon.nvml.write()
    daemon.write_config(deviceListStrategy=["cdi-cri"], deviceNodes=True, devRoot=str(dev))
    started(daemon)
    (allocation,) = daemon.admit(daemon.place("cdi", 16, gpu=[2, 0]))
    response = allocation.response
    gpus = daemon.nvml.gpus
    assert [d.name for d in response.cdi_devices] == [
        f"nvidia.com/gpu={gpus[2].uuid}",
        f"nvidia.com/gpu={gpus[0].uuid}",
    ]
    assert "NVIDIA_VISIBLE_DEVICES" not in response.envs
    assert response.envs["ALIYUN_COM_GPU_MEM_IDX"] == "2,0"
    assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
        ("/dev/nvidia7", f"{dev}/dev/nvidia7", "rw"),
        ("/dev/nvidia0", f"{dev}/dev/nvidia0", "rw"),
        ("/dev/nvidiactl", f"{dev}/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", f"{dev}/dev/nvidia-uvm", "rw"),
    ]


def test_volume_mounts_name_the_gpu_where_a_pod_cannot_forge_it(daemon: Daemon) -> None:
    daemon.write_config(deviceListStrategy="volume-mounts", deviceNodes=False)
    started(daemon)
    (allocation,) = daemon.admit(daemon.place("mounted", 4, gpu=1))
    uuid = daemon.nvml.gpus[1].uuid
    assert allocation.response.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert [(m.container_path, m.host_path, m.read_only) for m in allocation.response.mounts] == [
        (f"/var/run/nvidia-container-devices/{uuid}", "/dev/null", True)
    ]
    assert not allocation.response.cdi_devices and not allocation.response.devices
