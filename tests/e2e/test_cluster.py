"""gpushared against the real kube-scheduler, kubelet and containerd (Kubernetes 1.20), GPUs simulated.

Each test proves one path a user depends on, from `kubectl apply` to the env inside the container, and
checks after every disturbance that no GPU holds more than it has.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpushared import contract
from gpushared.core.shared.ledger import holding_from_pod
from tests.e2e import demo, host
from tests.e2e.cluster import GPU_SIZES_MIB, NODE, ROOT, LocalCluster, wait_for
from tests.e2e.kube import Kube, gpu_pod

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def gpu_of(kube: Kube, pod: dict[str, object]) -> tuple[int, str]:
    """The GPU the extender recorded for a pod: its index and, from the node's inventory, its UUID."""
    annotations = pod["metadata"]["annotations"]  # type: ignore[index]
    index = int(annotations[contract.ALIYUN_GPU_MEM_IDX])
    return index, kube.inventory().gpus[index].uuid


def assert_no_gpu_over_capacity(kube: Kube) -> dict[int, int]:
    """Sum what the API says every live pod holds, per GPU, and compare with the GPUs' sizes (and the
    compute requests with 100 %)."""
    inventory = kube.inventory()
    used: dict[int, int] = defaultdict(int)
    compute: dict[int, int] = defaultdict(int)
    for pod in kube.all_pods():
        holding = holding_from_pod(pod, unit=inventory.unit)
        if holding is not None and pod["spec"].get("nodeName") == NODE:
            assert not holding.pending, f"{pod['metadata']['name']} runs on the node without a GPU choice"
            for index, amount in holding.gpus.items():
                used[index] += amount
                compute[index] += holding.compute
    for index, amount in used.items():
        assert amount <= inventory.gpus[index].memory, f"GPU {index}: {amount} > {inventory.gpus[index].memory}"
        assert compute[index] <= 100, f"GPU {index}: compute requests of {compute[index]}%"
    return dict(used)


@pytest.fixture
def binpack_extender(cluster: LocalCluster) -> Iterator[None]:
    """The extender on ``--policy binpack`` (best fit, Aliyun's choice within a node), the default (fgd)
    afterwards: for a test that names the GPU best fit takes."""
    cluster.scheduling.restart_extender("--policy", "binpack")
    yield
    cluster.scheduling.restart_extender()


@pytest.mark.usefixtures("binpack_extender")
def test_compute_requests_share_a_gpu_up_to_all_of_its_compute(kube: Kube, namespace: str) -> None:
    """Three pods whose compute requests sum to 100 % share the 8 GiB GPU (best fit: memory is plentiful
    there); a pod that asks for 10 % of each of the four GPUs then stays Pending with the extender's
    reason, though every GPU has the memory it asks for; one that asks for 10 % of one GPU runs on
    another GPU."""
    for name, share in (("floor-a", "30"), ("floor-b", "30"), ("floor-c", "40")):
        body = gpu_pod(name, 2, annotations={contract.POD_COMPUTE_REQUEST: share, contract.POD_COMPUTE_LIMIT: "60"})
        kube.create(namespace, body)
        [pod] = kube.wait_running(namespace, name)
        assert gpu_of(kube, pod)[0] == 3
        recorded = contract.parse_allocation(pod["metadata"]["annotations"][contract.POD_ALLOCATION])
        assert recorded.compute == contract.ComputeShare(int(share), 60)
    wide = gpu_pod("on-all-four", 8, annotations={contract.POD_COMPUTE_REQUEST: "10"})
    wide["spec"]["containers"][0]["resources"]["limits"][contract.DEFAULT_RESOURCES.gpu_count] = "4"
    kube.create(namespace, wide)
    message = kube.wait_event(namespace, "on-all-four", lambda reason, _: reason == "FailedScheduling")
    assert "GPU 3 has 0 percent of its compute unrequested, pod requests 10 percent on each of 4 GPUs" in message, (
        message
    )
    assert not kube.pod(namespace, "on-all-four")["spec"].get("nodeName")
    kube.create(namespace, gpu_pod("beside", 2, annotations={contract.POD_COMPUTE_REQUEST: "10"}))
    [beside] = kube.wait_running(namespace, "beside")
    assert gpu_of(kube, beside)[0] != 3
    assert_no_gpu_over_capacity(kube)


def test_seed_sample_is_scheduled_by_the_extender_and_allocated_by_the_kubelet(
    kube: Kube, cluster: LocalCluster, namespace: str
) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", ROOT / "deploy" / "examples" / "binpack-1.yaml")
    pod = wait_for(lambda: next(iter(kube.pods(namespace, "app=binpack-1")), None), timeout=30, what="a binpack-1 pod")
    name = pod["metadata"]["name"]
    [pod] = kube.wait_running(namespace, name)

    annotations = pod["metadata"]["annotations"]
    assert annotations[contract.ALIYUN_GPU_MEM_ASSIGNED] == "true"  # the daemon's Allocate marked it
    assert annotations[contract.ALIYUN_GPU_MEM_POD] == "2"
    index, uuid = gpu_of(kube, pod)
    assert pod["spec"]["nodeName"] == NODE
    assert ("Scheduled", f"Successfully assigned {namespace}/{name} to {NODE}") in kube.events(namespace, name)

    logs = kube.logs(namespace, name)  # the sample's own command: env | grep ...
    assert f"NVIDIA_VISIBLE_DEVICES={uuid}" in logs
    assert f"ALIYUN_COM_GPU_MEM_IDX={index}" in logs
    assert "ALIYUN_COM_GPU_MEM_POD=2" in logs
    assert "ALIYUN_COM_GPU_MEM_CONTAINER=2" in logs
    assert f"ALIYUN_COM_GPU_MEM_DEV={GPU_SIZES_MIB[index] // 1024}" in logs


@pytest.mark.usefixtures("binpack_extender")
def test_equal_pods_created_at_once_each_get_the_gpu_in_their_annotation(kube: Kube, namespace: str) -> None:
    names = [f"same-{i}" for i in range(6)]
    threads = [threading.Thread(target=kube.create, args=(namespace, gpu_pod(n, 4))) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pods = kube.wait_running(namespace, *names, timeout=120)

    gpus = set()
    for pod in pods:
        index, uuid = gpu_of(kube, pod)
        gpus.add(index)
        env = kube.env_of(namespace, pod["metadata"]["name"])
        assert env["NVIDIA_VISIBLE_DEVICES"] == uuid
        assert env["ALIYUN_COM_GPU_MEM_IDX"] == str(index)
        assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"
    # Binpack on 16/12/24/8 GiB: two pods fill the 8 GiB GPU, three the 12 GiB one, the last goes to 16 GiB.
    assert assert_no_gpu_over_capacity(kube) == {3: 8, 1: 12, 0: 4}
    assert gpus == {0, 1, 3}


@pytest.mark.usefixtures("binpack_extender")
def test_multi_container_pod_shares_one_gpu_with_per_container_amounts(kube: Kube, namespace: str) -> None:
    kube.create(namespace, gpu_pod("pair", 3, 5, 0))
    [pod] = kube.wait_running(namespace, "pair")
    index, uuid = gpu_of(kube, pod)
    first, second = kube.env_of(namespace, "pair", "c0"), kube.env_of(namespace, "pair", "c1")
    assert first["NVIDIA_VISIBLE_DEVICES"] == second["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert (first["ALIYUN_COM_GPU_MEM_CONTAINER"], second["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("3", "5")
    assert first["ALIYUN_COM_GPU_MEM_POD"] == second["ALIYUN_COM_GPU_MEM_POD"] == "8"
    assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(namespace, "pair", "c2")  # no gpu-mem, no GPU
    assert index == 3  # 8 GiB fits the 8 GiB GPU exactly: best fit


def test_a_pod_larger_than_any_gpu_stays_pending_with_the_extenders_reason(kube: Kube, namespace: str) -> None:
    kube.create(namespace, gpu_pod("too-big", 30))
    message = kube.wait_event(namespace, "too-big", lambda reason, _: reason == "FailedScheduling")
    # kube-scheduler quotes the extender's FailedNodes reason for our node.
    assert "1 no usable GPU has 30 GiB free" in message, message
    assert kube.pod(namespace, "too-big")["status"]["phase"] == "Pending"
    assert not kube.pod(namespace, "too-big")["spec"].get("nodeName")


@pytest.mark.usefixtures("binpack_extender")
def test_a_container_on_several_gpus_sees_each_of_them(kube: Kube, namespace: str) -> None:
    """gpu-count: kube-scheduler counts the gpu-count the daemon advertises, the extender picks the GPUs, the
    kubelet hands the container devices of each, and the container sees every UUID."""
    wide = {"pair": (16, 2), "too-wide": (40, 2), "wide": (24, 2), "late": (8, 2)}  # GiB in all, GPUs
    bodies = {name: gpu_pod(name, total) for name, (total, _) in wide.items()}
    for name, body in bodies.items():
        body["spec"]["containers"][0]["resources"]["limits"][contract.DEFAULT_RESOURCES.gpu_count] = str(wide[name][1])
    inventory = kube.inventory()

    def placed(name: str) -> list[int]:
        annotations = kube.pod(namespace, name)["metadata"]["annotations"]
        assert contract.ALIYUN_GPU_MEM_IDX not in annotations  # Aliyun's annotations name one GPU
        return [
            share.index for share in contract.parse_allocation(annotations[contract.POD_ALLOCATION]).containers[0].gpus
        ]

    kube.create(namespace, bodies["pair"])
    kube.wait_running(namespace, "pair")
    assert placed("pair") == [3, 1]  # best fit for 8 GiB on each of two of 16/12/24/8 GiB: the 8, then the 12
    env = kube.env_of(namespace, "pair")
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{inventory.gpus[3].uuid},{inventory.gpus[1].uuid}"
    assert env["DEVICES"].split() == ["nvidia-uvm", "nvidia1", "nvidia3", "nvidiactl"]  # deviceNodes
    assert (env["ALIYUN_COM_GPU_MEM_IDX"], env["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("3,1", "16")
    kube.create(namespace, bodies["too-wide"])  # 20 GiB on each of two: only GPU 2 has that much
    message = kube.wait_event(namespace, "too-wide", lambda reason, _: reason == "FailedScheduling")
    assert "1 fewer than 2 usable GPUs have 20 GiB free each" in message, message
    kube.create(namespace, bodies["wide"])  # 12 GiB on each: GPUs 0 (16 free) and 2 (24)
    kube.wait_running(namespace, "wide")
    assert placed("wide") == [0, 2]
    assert assert_no_gpu_over_capacity(kube) == {3: 8, 1: 8, 0: 12, 2: 12}
    # kube-scheduler counts gpu-count against the node's four GPUs: two pairs ask for all four, so a third
    # pair waits, though GPUs 0, 1 and 2 have the 4 GiB each it asks for.
    kube.create(namespace, bodies["late"])
    message = kube.wait_event(namespace, "late", lambda reason, _: reason == "FailedScheduling")
    assert "Insufficient aliyun.com/gpu-count" in message, message


def test_kubelet_restart_reregisters_and_leaves_running_pods_alone(
    kube: Kube, cluster: LocalCluster, namespace: str
) -> None:
    kube.create(namespace, gpu_pod("before", 6))
    [before] = kube.wait_running(namespace, "before")
    container_id = before["status"]["containerStatuses"][0]["containerID"]
    total = kube.allocatable()
    registrations = cluster.node.daemon_registrations()

    cluster.node.restart_kubelet()
    # kubelet 1.20 deletes every socket in the plugin dir at start; gpushared must notice and register again,
    # and the kubelet must read the devices before it can admit a GPU pod (until then: UnexpectedAdmissionError).
    wait_for(
        lambda: (
            cluster.node.daemon_registrations() > registrations and cluster.node.daemon_status().get("kubeletWatching")
        ),
        timeout=30,
        what="gpushared registered with the new kubelet, which reads its devices",
    )
    wait_for(lambda: kube.allocatable() == total, timeout=60, what="gpu-mem allocatable back after kubelet restart")
    status = kube.pod(namespace, "before")["status"]["containerStatuses"][0]
    assert status["containerID"] == container_id and status["restartCount"] == 0 and "running" in status["state"]

    kube.create(namespace, gpu_pod("after", 6))
    [after] = kube.wait_running(namespace, "after")
    assert kube.env_of(namespace, "after")["NVIDIA_VISIBLE_DEVICES"] == gpu_of(kube, after)[1]
    assert_no_gpu_over_capacity(kube)


def test_extender_restart_under_load_rebuilds_its_state(kube: Kube, cluster: LocalCluster, namespace: str) -> None:
    # 20 pods of 1-5 GiB (60 GiB asked of 60 GiB): the extender is killed while the scheduler works through them.
    sizes = [1 + i % 5 for i in range(20)]
    names = [f"load-{i}" for i in range(len(sizes))]

    def create_all() -> None:
        for name, size in zip(names, sizes, strict=True):
            kube.create(namespace, gpu_pod(name, size))
            time.sleep(0.05)

    creator = threading.Thread(target=create_all)
    creator.start()
    time.sleep(0.5)
    cluster.scheduling.restart_extender(kill=True)
    creator.join()
    time.sleep(1)
    cluster.scheduling.restart_extender(kill=True)

    def settled() -> bool:
        pods = kube.pods(namespace)
        bound = [p for p in pods if p["spec"].get("nodeName")]
        return (
            len(pods) == len(names) and all(p["status"].get("phase") == "Running" for p in bound) and len(bound) >= 15
        )

    wait_for(settled, timeout=180, what="the load to be scheduled after extender restarts", interval=1)
    used = assert_no_gpu_over_capacity(kube)
    # The rebuilt extender's cache agrees with the API about every GPU.
    node = cluster.scheduling.extender_inspect()
    assert {d["id"]: d["usedGPU"] for d in node["devs"] if d["usedGPU"]} == used
    for pod in kube.pods(namespace):
        if pod["status"].get("phase") == "Running":
            assert kube.env_of(namespace, pod["metadata"]["name"])["NVIDIA_VISIBLE_DEVICES"] == gpu_of(kube, pod)[1]


def test_gpushared_restart_keeps_allocations(kube: Kube, cluster: LocalCluster, namespace: str) -> None:
    kube.create(namespace, gpu_pod("kept", 7))
    [kept] = kube.wait_running(namespace, "kept")
    uuid = gpu_of(kube, kept)[1]
    inventory = kube.inventory()

    cluster.node.restart_daemon()
    wait_for(lambda: cluster.node.daemon_status().get("kubeletWatching"), timeout=30, what="gpushared registered again")
    assert kube.inventory() == inventory
    status = kube.pod(namespace, "kept")["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and "running" in status["state"]
    assert kube.env_of(namespace, "kept")["NVIDIA_VISIBLE_DEVICES"] == uuid

    kube.create(namespace, gpu_pod("next", 7))
    [following] = kube.wait_running(namespace, "next")
    assert kube.env_of(namespace, "next")["NVIDIA_VISIBLE_DEVICES"] == gpu_of(kube, following)[1]
    assert_no_gpu_over_capacity(kube)


def test_kubectl_inspect_gpushare_shows_the_allocations(kube: Kube, cluster: LocalCluster, namespace: str) -> None:
    kube.create(namespace, gpu_pod("shown", 5))
    [pod] = kube.wait_running(namespace, "shown")
    index, _ = gpu_of(kube, pod)
    env = {**os.environ, **cluster.env()}
    table = subprocess.run(
        [str(cluster.bin / "kubectl"), "inspect", "gpushare", "-d"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert table.returncode == 0, table.stderr
    assert NODE in table.stdout and "shown" in table.stdout, table.stdout
    report = cluster.inspect_json()
    [node] = [n for n in report["nodes"] if n["name"] == NODE]
    [dev] = [d for d in node["devs"] if d["id"] == index]
    assert {"name": "shown", "namespace": namespace, "usedGPU": 5} in dev["pods"]


@pytest.fixture
def mib_node(kube: Kube, cluster: LocalCluster) -> object:
    """The node re-inventoried in MiB with GPUs of 12207, 8138, 4069 and 16276 MiB, restored afterwards."""
    cluster.gpus.write_gpus((12207, 8138, 4069, 16276))
    cluster.node.restart_daemon(memory_unit="MiB")
    wait_for(lambda: kube.allocatable() == 12207 + 8138 + 4069 + 16276, timeout=60, what="the MiB inventory")
    yield
    cluster.gpus.write_gpus(GPU_SIZES_MIB)
    cluster.node.restart_daemon()
    wait_for(lambda: kube.allocatable() == sum(GPU_SIZES_MIB) // 1024, timeout=60, what="the GiB inventory")


@pytest.mark.usefixtures("mib_node", "binpack_extender")
def test_best_fit_picks_the_gpu_whose_free_memory_matches(kube: Kube, namespace: str) -> None:
    kube.create(namespace, gpu_pod("fit", 8138))
    [pod] = kube.wait_running(namespace, "fit")
    index, uuid = gpu_of(kube, pod)
    assert index == 1  # 12207 / 8138 / 4069 / 16276 MiB free: 8138 is the least that fits
    assert kube.env_of(namespace, "fit")["NVIDIA_VISIBLE_DEVICES"] == uuid


@pytest.mark.usefixtures("binpack_extender")
def test_an_mps_pod_gets_the_gpus_daemon_and_plain_pods_stay_off_its_gpu(
    kube: Kube, cluster: LocalCluster, namespace: str
) -> None:
    mps = {contract.POD_MPS: "true"}
    kube.create(namespace, gpu_pod("mps-a", 4, annotations=mps))
    [pod] = kube.wait_running(namespace, "mps-a")
    index, uuid = gpu_of(kube, pod)
    assert index == 3  # best fit: the 8 GiB GPU
    env = kube.env_of(namespace, "mps-a")
    assert env["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"  # 4 of 8 GiB
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    # The real kubelet mounted the GPU's pipe directory and its private /dev/shm into the container.
    listing = cluster.kubectl("-n", namespace, "exec", "mps-a", "--", "ls", "/tmp/nvidia-mps").stdout.split()
    assert "control" in listing
    cluster.kubectl("-n", namespace, "exec", "mps-a", "--", "touch", "/dev/shm/from-the-pod")
    assert (cluster.mps_root / uuid / "shm" / "from-the-pod").exists()

    # A plain pod would best-fit the 4 GiB left on GPU 3; it must go elsewhere. Another MPS pod joins GPU 3.
    kube.create(namespace, gpu_pod("plain", 2))
    kube.create(namespace, gpu_pod("mps-b", 2, annotations=mps))
    plain, second = kube.wait_running(namespace, "plain", "mps-b")
    assert gpu_of(kube, plain)[0] != index
    assert "CUDA_MPS_PIPE_DIRECTORY" not in kube.env_of(namespace, "plain")
    assert gpu_of(kube, second)[0] == index
    assert kube.env_of(namespace, "mps-b")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert_no_gpu_over_capacity(kube)


def test_a_pod_without_gpu_goes_where_no_gpu_memory_is_free(kube: Kube, cluster: LocalCluster, namespace: str) -> None:
    """The second extender entry of the shipped config (prioritize-no-gpu) steers a CPU-only pod off the GPU
    node, whose GPUs are all free, onto a node without GPUs that kube-scheduler alone would not pick: it is
    smaller (LeastAllocated) and lacks the image (ImageLocality). The node is an API object only; no kubelet
    runs it, so the pod is only bound, then removed with the node."""
    gpuless = "gpuless-e2e"
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    kube.core.create_node({"metadata": {"name": gpuless, "labels": {"kubernetes.io/hostname": gpuless}}})
    try:
        kube.core.patch_node_status(
            gpuless,
            {
                "status": {
                    "capacity": {"cpu": "1", "memory": "1Gi", "pods": "10"},
                    "allocatable": {"cpu": "1", "memory": "1Gi", "pods": "10"},
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "lastHeartbeatTime": now,
                            "lastTransitionTime": now,
                        }
                    ],
                }
            },
        )
        # A new node carries the not-ready taint until the node lifecycle controller has seen it Ready; a pod
        # scheduled before that cannot go there (a CI run lost this race), nor before kube-scheduler's
        # informer has the node's allocatable CPU.
        wait_for(lambda: not kube.core.read_node(gpuless).spec.taints, timeout=30, what="the not-ready taint gone")
        time.sleep(2)
        kube.create(namespace, gpu_pod("cpu-only", 0))
        bound = wait_for(
            lambda: kube.pod(namespace, "cpu-only")["spec"].get("nodeName"), timeout=30, what="cpu-only bound"
        )
        assert bound == gpuless, kube.describe(namespace, "cpu-only")
        with urllib.request.urlopen(
            f"{cluster.scheduling.extender_url}/metrics", timeout=5, context=cluster.scheduling.extender_tls()
        ) as response:
            metrics = response.read().decode()
        assert 'gpushared_extender_request_seconds_count{verb="prioritize-no-gpu"}' in metrics
    finally:
        cluster.kubectl("-n", namespace, "delete", "pod", "cpu-only", "--grace-period=0", "--force", check=False)
        kube.core.delete_node(gpuless)


def test_device_nodes_give_a_container_its_gpus_files_and_no_other(kube: Kube, namespace: str) -> None:
    """deviceNodes: containerd creates the device specs Allocate returned and opens the device cgroup for
    them, with no NVIDIA hook in the runtime. The fake GPUs' files are /dev/null's numbers under the daemon's
    devRoot; each container must see its own GPU's file, the control devices, and nothing of the other GPUs."""
    kube.create(namespace, gpu_pod("one-gpu", 7))
    kube.create(namespace, gpu_pod("no-gpu", 0))
    kube.wait_running(namespace, "one-gpu", "no-gpu")
    index, uuid = gpu_of(kube, kube.pod(namespace, "one-gpu"))
    env = kube.env_of(namespace, "one-gpu")
    assert env["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert env["DEVICES"].split() == sorted(["nvidia-uvm", f"nvidia{index}", "nvidiactl"])
    assert kube.env_of(namespace, "no-gpu")["DEVICES"].split() == []
    # The file is usable, not just listed: the device cgroup lets the container open it.
    write = f"echo probe > /dev/nvidia{index} && echo written"
    opened = kube.cluster.kubectl("exec", "-n", namespace, "one-gpu", "--", "sh", "-c", write, check=False)
    assert opened.stdout.strip() == "written", opened.stderr


@pytest.mark.timeout(600)
def test_the_demo_samples_run_ten_times_in_a_row_in_any_order(
    kube: Kube, cluster: LocalCluster, namespace: str
) -> None:
    """`make demo`'s own sample runner, ten rounds, each from a clean node and in a namespace of its own,
    applying the manifests' objects in another order: every round all nine pods run, none over capacity.

    Clean means that no pod on the node holds GPU memory, by the rule the extender and the daemon count by
    (a deleted pod's memory is free once all its containers have stopped). The kubelet (1.20) then took
    30-50 s more to remove the pod objects, so each round has a namespace of its own and the old ones
    are removed together at the end."""
    rounds: list[str] = []
    used_namespaces = []
    try:
        for number in range(10):
            wait_for(lambda: assert_no_gpu_over_capacity(kube) == {}, timeout=120, what="no pod holding GPU memory")
            space = f"{namespace}-{number}"
            kube.create_namespace(space)
            used_namespaces.append(space)
            took = demo.run_samples(cluster, namespace=space, timeout=120, shuffle=random.Random(number), report=print)
            pods = kube.pods(space)
            assert len(pods) == demo.SAMPLE_PODS and all(p["status"]["phase"] == "Running" for p in pods)
            assert sum(assert_no_gpu_over_capacity(kube).values()) == 23  # the samples' GiB, all placed
            started = time.monotonic()
            demo.delete_samples(cluster, namespace=space)
            wait_for(lambda: assert_no_gpu_over_capacity(kube) == {}, timeout=120, what="the samples' GPU memory freed")
            rounds.append(f"{took:.1f}/{time.monotonic() - started:.1f}")
        print(f"demo samples, 10 rounds, seconds until running / until their GPU memory was free: {rounds}")
    finally:
        for space in used_namespaces:
            cluster.kubectl("delete", "namespace", space, "--wait=false", check=False)


@pytest.fixture
def gpu_processes(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The fake NVML's process lists, emptied again after the test."""
    yield cluster
    cluster.gpus.clear_gpu_processes()


def test_memory_past_the_allocation_is_reported_then_killed_and_the_neighbour_untouched(
    kube: Kube, gpu_processes: LocalCluster, namespace: str
) -> None:
    cluster = gpu_processes
    kube.create(namespace, gpu_pod("reported", 2))
    kube.create(namespace, gpu_pod("killed", 2, annotations={contract.POD_MEMORY_ENFORCEMENT: "kill"}))
    kube.create(namespace, gpu_pod("polite", 4))
    pods = {p["metadata"]["name"]: p for p in kube.wait_running(namespace, "reported", "killed", "polite")}

    def main_pid(name: str) -> int:
        container_id = pods[name]["status"]["containerStatuses"][0]["containerID"].rpartition("://")[2]
        pids = wait_for(lambda: host.container_pids(container_id), timeout=30, what=f"{name}'s processes")
        return int(pids[0])

    listed: dict[int, list[tuple[int, int]]] = defaultdict(list)
    # 7,500 MiB in all: under every GPU's size less the reserve, so no neighbour protection comes into it.
    for name, mib in (("reported", 3000), ("killed", 3000), ("polite", 1500)):
        listed[gpu_of(kube, pods[name])[0]].append((main_pid(name), mib))
    for index, processes in listed.items():
        cluster.gpus.set_gpu_processes(index, processes)

    over = kube.wait_event(namespace, "reported", lambda r, m: r == "GPUMemoryOverLimit", timeout=30)
    assert "uses 3000 MiB" in over and "allocated 2048 MiB" in over and "report" in over
    killed = kube.wait_event(namespace, "killed", lambda r, m: "killed process" in m, timeout=60)
    assert "still over after the grace period" in killed

    def restarted() -> bool:
        status = kube.pod(namespace, "killed")["status"]["containerStatuses"][0]
        return status["restartCount"] == 1 and "running" in status["state"]

    wait_for(restarted, timeout=60, what="the killed container to be restarted by the kubelet")
    for name in ("reported", "polite"):
        assert kube.pod(namespace, name)["status"]["containerStatuses"][0]["restartCount"] == 0, name
    assert not [r for r, _ in kube.events(namespace, "polite") if r == "GPUMemoryOverLimit"]
    samples = {
        (sample.name, sample.labels["pod"]): sample.value
        for family in text_string_to_metric_families(cluster.node.daemon_metrics())
        for sample in family.samples
        if sample.name.startswith("gpushared_container_gpu_memory_")
    }
    for name, used, allocated in (("reported", 3000, 2048), ("polite", 1500, 4096)):
        assert samples[("gpushared_container_gpu_memory_used_bytes", name)] == used * 2**20, name
        assert samples[("gpushared_container_gpu_memory_allocated_bytes", name)] == allocated * 2**20, name
