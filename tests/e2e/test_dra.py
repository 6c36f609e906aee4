"""gpushared as a DRA driver on a real cluster (Kubernetes >= 1.34: resource.k8s.io/v1), GPUs simulated.

kube-scheduler allocates ResourceClaims from the ResourceSlice the daemon publishes, by consumable
capacity, with no extender; the kubelet registers the daemon's plugin, asks it to prepare each claim and
gives the container its CDI devices (containerd >= 1.7 with CDI on; tests/e2e/versions.py); the claim is
unprepared when the pod goes. Every case runs whenever the harness's cache holds Kubernetes >= 1.34
(GPUSHARED_K8S_CACHE) and is skipped, saying why, on the 1.20 Debian builds: the cases are written for the
newer binaries and run unchanged on them.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gpushared.contract import dra
from gpushared.core.shared.quantity import parse_whole_quantity
from tests.e2e.cluster import GPU_SIZES_MIB, NODE, ROOT, LocalCluster, cached_version, wait_for
from tests.e2e.gpus import NVLINK_PAIRS
from tests.e2e.kube import PRINT_ENV, Kube
from tests.e2e.versions import Version, serves_dra

VERSION = cached_version("kube-apiserver")
#: Decided before any cluster starts: on the 1.20 Debian builds these cases are skipped, saying why (and those
#: of tests/e2e/test_dra_allocator.py, which share this module's node in DRA mode).
NEEDS_DRA = pytest.mark.skipif(
    VERSION is None or not serves_dra(VERSION),
    reason=f"DRA (resource.k8s.io/v1) needs Kubernetes >= 1.34; the harness's binaries are {VERSION}",
)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), NEEDS_DRA]

GI = 2**30
DRA = ROOT / "deploy" / "dra"


@pytest.fixture(scope="module")
def dra_node(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The node in DRA mode for this module's cases; in device-plugin mode again after them."""
    for name in ("deviceclass.yaml", "driver-rbac.yaml", "admission-policy.yaml"):
        cluster.kubectl("apply", "-f", DRA / name)
    own = f"gpushared-node-{NODE}"
    for role in ("gpushared-node", "gpushared-dra-driver"):
        cluster.kubectl(
            "create", "clusterrolebinding", f"{own}-{role}", f"--clusterrole={role}",
            f"--serviceaccount=kube-system:{own}",
        )  # fmt: skip
    cluster.gpus.write_gpus(GPU_SIZES_MIB, nvlink=NVLINK_PAIRS)
    cluster.node.restart_daemon(dra=True)
    cluster.node.wait_serving()
    wait_for(lambda: slices(cluster), timeout=60, what="the node's ResourceSlice")
    yield cluster
    cluster.gpus.write_gpus(GPU_SIZES_MIB)
    cluster.node.restart_daemon()
    cluster.node.wait_serving()
    cluster.node.wait_ready()
    cluster.kubectl("delete", "resourceslices", "--all", check=False)
    for role in ("gpushared-node", "gpushared-dra-driver"):
        cluster.kubectl("delete", "clusterrolebinding", f"{own}-{role}", check=False)
    cluster.kubectl("delete", "-f", DRA / "admission-policy.yaml", check=False)


def get(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def slices(cluster: LocalCluster) -> list[dict[str, Any]]:
    return [s for s in get(cluster, "resourceslices")["items"] if s["spec"]["driver"] == dra.DRIVER]


def claim_body(
    name: str, memory: str | None, *, config: dict[str, Any] | None = None, compute: str | None = None
) -> dict[str, Any]:
    capacity = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    exactly: dict[str, Any] = {"deviceClassName": dra.DEVICE_CLASS}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if config is not None:
        parameters = {"apiVersion": dra.CONFIG_API_VERSION, "kind": dra.CONFIG_KIND, **config}
        devices["config"] = [{"requests": ["gpu"], "opaque": {"driver": dra.DRIVER, "parameters": parameters}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": devices},
    }


def template_body(name: str, memory: str) -> dict[str, Any]:
    """A ResourceClaimTemplate whose claims ask ``memory`` of one GPU."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": claim_body("x", memory)["spec"]},
    }


def claim_pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {
                    "name": name,
                    "image": "busybox",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sh", "-c", PRINT_ENV],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def claims_pod(name: str, *claims: str, only: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """A pod whose container ``name`` names every claim (by the claim's own name), and whose containers in
    ``only`` name those claims alone."""
    body = claim_pod(name, claims[0])
    body["spec"]["resourceClaims"] = [{"name": c, "resourceClaimName": c} for c in claims]
    (container,) = body["spec"]["containers"]
    container["resources"] = {"claims": [{"name": c} for c in claims]}
    for other, named in (only or {}).items():
        body["spec"]["containers"].append(
            {**container, "name": other, "resources": {"claims": [{"name": c} for c in named]}}
        )
    return body


def told_every_gpu(cluster: LocalCluster, kube: Kube, namespace: str, pod: str, claims: tuple[str, ...]) -> list[int]:
    """The GPU indexes the claims were allocated, after checking the container named ``pod`` is told each of
    them once, whatever order containerd applied the claims' CDI devices in: in NVIDIA_VISIBLE_DEVICES and
    ALIYUN_COM_GPU_MEM_IDX, with the sum of the claims' memory in ALIYUN_COM_GPU_MEM_CONTAINER, and each
    claim's own GPU in its own variable (GPUSHARED_CLAIM_<UID>_<REQUEST>)."""
    devices = {d["name"]: d["attributes"] for s in slices(cluster) for d in s["spec"]["devices"]}
    bodies = {c["metadata"]["name"]: c for c in get(cluster, "-n", namespace, "resourceclaims")["items"]}
    allocated = allocations(cluster, namespace)
    env = kube.env_of(namespace, pod)
    gpus: dict[int, str] = {}
    memory = 0
    for name in claims:
        (result,) = allocated[name]
        attributes = devices[result["device"]]
        uuid = attributes["uuid"]["string"]
        gpus[attributes["index"]["int"]] = uuid
        memory += parse_whole_quantity("memory", result["consumedCapacity"]["memory"]) // GI
        own = "GPUSHARED_CLAIM_" + bodies[name]["metadata"]["uid"].replace("-", "").upper() + "_GPU"
        assert env[own] == uuid, (own, env)
    assert sorted(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(gpus.values()), env
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == ",".join(str(i) for i in sorted(gpus)), env
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(memory), env
    return sorted(gpus)


def apply(cluster: LocalCluster, namespace: str, *bodies: dict[str, Any]) -> None:
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump_all(bodies))


def allocations(cluster: LocalCluster, namespace: str) -> dict[str, list[dict[str, Any]]]:
    found = {}
    for claim in get(cluster, "-n", namespace, "resourceclaims")["items"]:
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
        found[claim["metadata"]["name"]] = [r for r in results if r["driver"] == dra.DRIVER]
    return found


def assert_no_gpu_over_capacity(cluster: LocalCluster) -> None:
    """Every claim the API server holds, summed per device, against what the slice says each GPU has."""
    sizes = {
        d["name"]: parse_whole_quantity("memory", d["capacity"]["memory"]["value"])
        for s in slices(cluster)
        for d in s["spec"]["devices"]
    }
    used: dict[str, int] = defaultdict(int)
    for claim in get(cluster, "resourceclaims", "--all-namespaces")["items"]:
        for result in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []:
            if result["driver"] == dra.DRIVER:
                used[result["device"]] += parse_whole_quantity(
                    "memory", (result.get("consumedCapacity") or {}).get("memory", "0")
                )
    for device, amount in used.items():
        assert amount <= sizes[device], f"{device}: {amount} bytes claimed of {sizes[device]}"


def test_claims_share_gpus_by_memory_and_what_does_not_fit_waits(
    dra_node: LocalCluster, kube: Kube, namespace: str
) -> None:
    """The issue's check, on the real scheduler: 6 GiB claims fill the 16, 12, 24 and 8 GiB GPUs two, two,
    four and one at a time; the tenth waits ("cannot allocate all claims"); each container gets the GPU its
    claim was allocated (when containerd applies CDI); deleting the pods unprepares the claims."""
    cluster = dra_node
    names = [f"c{i}" for i in range(10)]
    apply(cluster, namespace, *(claim_body(n, "6Gi") for n in names), *(claim_pod(f"p-{n}", n) for n in names))
    wait_for(
        lambda: sum(1 for r in allocations(cluster, namespace).values() if r) == 9,
        timeout=90,
        what="9 claims allocated",
    )
    time.sleep(3)
    allocated = allocations(cluster, namespace)
    assert sum(1 for r in allocated.values() if r) == 9
    assert_no_gpu_over_capacity(cluster)
    (waiting,) = [n for n, r in allocated.items() if not r]
    assert kube.pod(namespace, f"p-{waiting}")["status"].get("phase") == "Pending"
    running = [n for n, r in allocated.items() if r]
    kube.wait_running(namespace, *(f"p-{n}" for n in running), timeout=120)
    uuids = {d["name"]: d["attributes"]["uuid"]["string"] for s in slices(cluster) for d in s["spec"]["devices"]}
    prepared = {c["name"] for c in cluster.node.daemon_status()["claims"]}
    assert prepared == set(running)
    for name in running:
        (result,) = allocated[name]
        assert result["consumedCapacity"]["memory"] in ("6Gi", str(6 * GI))
        if containerd_applies_cdi(cluster):
            env = kube.env_of(namespace, f"p-{name}")
            assert env["NVIDIA_VISIBLE_DEVICES"] == uuids[result["device"]]
            assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "6"
    cluster.kubectl("-n", namespace, "delete", "pods", "--all", "--grace-period=2")
    wait_for(lambda: not cluster.node.daemon_status().get("claims"), timeout=60, what="every claim unprepared")
    assert not list(cluster.cdi_root.glob("gpushared.io-claim_*.json"))


def test_a_claim_from_a_template_and_an_mps_claim(dra_node: LocalCluster, kube: Kube, namespace: str) -> None:
    """deploy/dra/examples' shapes: a template the controller manager turns into a claim per pod, and an MPS
    claim whose containers are clients of the GPU's MPS daemon, held to its memory and compute limit."""
    cluster = dra_node
    template = template_body("gpu-2gi", "2Gi")
    from_template = claim_pod("templated", "unused")
    from_template["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu-2gi"}]
    mps = claim_body("mps", "3Gi", compute="20", config={"mps": True, "computeLimit": 40})
    apply(cluster, namespace, template, from_template, mps, claim_pod("mps-client", "mps"))
    kube.wait_running(namespace, "templated", "mps-client", timeout=120)
    claims = {c["name"]: c for c in cluster.node.daemon_status()["claims"]}
    assert claims["mps"]["devices"][0]["mps"] is True
    assert claims["mps"]["devices"][0]["compute"] == 20
    if containerd_applies_cdi(cluster):
        env = kube.env_of(namespace, "mps-client")
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3072M"


def test_a_container_with_two_claims_is_told_both_gpus(dra_node: LocalCluster, kube: Kube, namespace: str) -> None:
    """Two 10 GiB claims named by one container, allocated by kube-scheduler alone: no GPU but the 24 GiB
    one holds both, and first fit puts them on GPUs 0 and 1. containerd applies the claims' CDI devices one
    after the other and keeps the last device's variables; each claim's spec names the other's GPU too, so
    the container is told both (docs/dra.md, "What the container gets")."""
    cluster = dra_node
    if not containerd_applies_cdi(cluster):
        pytest.skip("no runtime here applies CDI specs (containerd < 1.7): nothing gives the container its env")
    apply(
        cluster, namespace, claim_body("left", "10Gi"), claim_body("right", "10Gi"), claims_pod("both", "left", "right")
    )
    kube.wait_running(namespace, "both", timeout=120)
    assert len(told_every_gpu(cluster, kube, namespace, "both", ("left", "right"))) == 2


def test_containers_that_combine_a_claim_differently_are_refused_with_the_reason(
    dra_node: LocalCluster, kube: Kube, namespace: str
) -> None:
    """One container names claims a and b, another a alone: a's CDI spec, the same for both, cannot tell
    each its own GPUs, so the driver refuses to prepare the pod's claims, and the kubelet says why."""
    cluster = dra_node
    apply(
        cluster, namespace, claim_body("a", "1Gi"), claim_body("b", "1Gi"),
        claims_pod("mixed", "a", "b", only={"only-a": ["a"]}),
    )  # fmt: skip
    message = kube.wait_event(
        namespace, "mixed", lambda reason, _: reason == "FailedPrepareDynamicResources", timeout=120
    )
    assert "cannot tell each its own GPUs" in message, message
    assert "container only-a of pod" in message or "container mixed of pod" in message, message
    assert kube.pod(namespace, "mixed")["status"].get("phase") == "Pending"
    assert not cluster.node.daemon_status().get("claims"), "neither claim is prepared"


def test_a_restarted_daemon_unprepares_what_it_prepared_before(
    dra_node: LocalCluster, kube: Kube, namespace: str
) -> None:
    cluster = dra_node
    apply(cluster, namespace, claim_body("kept", "1Gi"), claim_pod("kept", "kept"))
    kube.wait_running(namespace, "kept")
    generation = slices(cluster)[0]["spec"]["pool"]["generation"]
    cluster.node.restart_daemon(dra=True)
    cluster.node.wait_serving()
    wait_for(lambda: cluster.node.daemon_status().get("claims"), timeout=60, what="the claims read back")
    assert slices(cluster)[0]["spec"]["pool"]["generation"] == generation
    cluster.kubectl("-n", namespace, "delete", "pod", "kept", "--grace-period=2")
    wait_for(lambda: not cluster.node.daemon_status().get("claims"), timeout=60, what="unprepared after the restart")


def test_a_node_may_not_write_another_nodes_slice(dra_node: LocalCluster) -> None:
    cluster = dra_node
    (mine,) = slices(cluster)
    other = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "someone-elses"},
        "spec": {**mine["spec"], "nodeName": "another-node", "pool": {**mine["spec"]["pool"], "name": "another-node"}},
    }
    result = cluster.kubectl(
        "--kubeconfig", cluster.kubeconfig_for("gpushared-node-own"), "create", "-f", "-",
        input=json.dumps(other), check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "may write only the ResourceSlices of its own node" in result.stderr


def containerd_applies_cdi(cluster: LocalCluster) -> bool:
    """CDI needs containerd >= 1.7 (the harness turns it on there); on 1.6 the claim is prepared and its
    spec written, but no runtime reads it."""
    return cluster.version("containerd") >= Version(1, 7)
