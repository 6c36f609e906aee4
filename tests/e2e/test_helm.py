"""The Helm chart on the real cluster, as an operator uses it: `helm install` (the extender, the second
scheduler chosen from the cluster's version, the webhook, the chart's certificates, and the node daemon
as a DaemonSet from its image in place of the host's), `helm test` (Aliyun's binpack sample placed and
given its GPU), `helm upgrade` keeping certificates that are still good and issuing them again inside
the renewal window, and `helm uninstall` leaving nothing behind.

The only edits are the ones this cluster forces (no kube-proxy, no DNS, one node): tests/e2e/manifests.py's
``local_chart``, applied by helm's own post-renderer. The chart's objects take over the RBAC the cluster
bootstrapped from deploy/ (``--take-ownership``), which is also how a cluster installed with kustomize
moves to the chart; the cluster's own is applied again afterwards.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushared import __version__
from tests.e2e import host
from tests.e2e.cluster import ROOT, LocalCluster, build_binary_image, wait_for
from tests.e2e.kube import Kube, gpu_pod
from tests.e2e.layout import KUBELET_ROOT, NODE, ClusterError
from tests.e2e.test_cluster import assert_no_gpu_over_capacity, gpu_of
from tests.e2e.test_control_plane import lease_holder, ready
from tests.e2e.versions import scheduler_api
from tests.harness import free_port
from tests.mps_binary import fetch_mps_control

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CHART = ROOT / "deploy" / "helm" / "gpushared"
RELEASE = "gpushared"
#: kube-system, as docs/install.md installs it: the RBAC subjects are then the ones the node daemon and
#: the cluster's extender already use, so nothing they hold changes while the chart's extender runs.
NAMESPACE = "kube-system"
TEST_POD = "gpushared-test-binpack"
#: the chart's DaemonSet runs on nodes with this label (values node.daemonset.nodeSelector)
DAEMONSET_LABEL = "gpushared.io/node-daemon"


def helm_binary() -> Path:
    result = subprocess.run([ROOT / "scripts" / "helm-bin"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"scripts/helm-bin: {result.stderr}"
    return Path(result.stdout.strip().splitlines()[-1]) / "helm"


class Helm:
    def __init__(self, cluster: LocalCluster, post_render: dict[str, Any]) -> None:
        self.binary = helm_binary()
        self.cluster = cluster
        self.post_render = [
            "--post-renderer", sys.executable,
            "--post-renderer-args=-m",
            "--post-renderer-args=tests.e2e.helm_post_render",
            f"--post-renderer-args={json.dumps(post_render)}",
        ]  # fmt: skip

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.binary, *args],
            env={**os.environ, **self.cluster.env()},
            cwd=ROOT,  # the post-renderer is `python -m tests.e2e.helm_post_render`
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check:
            assert result.returncode == 0, f"helm {' '.join(args)}: {result.stdout}{result.stderr}"
        return result

    def test(self) -> None:
        """helm test; on failure, what an operator would look at next: the test pod's events and the logs
        of the scheduler and the extender."""
        result = self("test", RELEASE, "-n", NAMESPACE, "--timeout", "180s", check=False)
        if result.returncode != 0:
            looks = [
                ("describe", "pod", TEST_POD),
                ("logs", TEST_POD),
                ("logs", "-l", "app=gpushared-scheduler", "--tail", "60"),
                ("logs", "-l", "app=gpushared-extender", "--tail", "60"),
                ("get", "pods,leases", "-o", "wide"),
            ]
            seen = "\n".join(self.cluster.kubectl("-n", NAMESPACE, *look, check=False).stdout for look in looks)
            pytest.fail(f"helm test failed: {result.stdout}{result.stderr}\n{seen}")
        assert "Phase:          Succeeded" in result.stdout, result.stdout
        # Deleted once it succeeded (hook-succeeded): nothing of it outlives the release.
        wait_for(lambda: not self.cluster.kubectl("-n", NAMESPACE, "get", "pod", TEST_POD, "--ignore-not-found",
                 "-o", "name").stdout.strip(), timeout=60, what="the succeeded test pod deleted")  # fmt: skip

    def deploy(self, verb: str, *settings: str) -> None:
        """helm install or upgrade, waiting until every Deployment is available."""
        self(verb, RELEASE, str(CHART), "-n", NAMESPACE, "--wait", "--timeout", "240s", *self.post_render, *settings)


def secret_data(kube: Kube, name: str) -> dict[str, bytes]:
    secret = kube.core.read_namespaced_secret(name, NAMESPACE)
    return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


def served_certificate(port: int) -> bytes | None:
    try:
        return der(ssl.get_server_certificate(("127.0.0.1", port), timeout=5).encode())
    except OSError:
        return None


def wait_for_leader(kube: Kube, cluster: LocalCluster) -> None:
    """Until the chart's extender (the one not terminating) is Ready (its cache synced) and holds the Lease.
    Pods still pending then wait out the fence a new leader keeps for Bindings its predecessor may have had
    in flight (design.md §8): correct, but longer than a test should wait. (helm --wait does not wait for
    it: with one replica and maxUnavailable 1 a Deployment counts as available with none Ready.)"""

    def leading() -> bool:
        pods = [p for p in kube.pods(NAMESPACE, "app=gpushared-extender") if "deletionTimestamp" not in p["metadata"]]
        if len(pods) != 1 or not ready(pods[0]):
            return False
        return lease_holder(cluster, "gpushared-extender").startswith(pods[0]["metadata"]["name"])

    wait_for(leading, timeout=120, what="the chart's extender Ready and leading")


def release_objects(cluster: LocalCluster) -> list[str]:
    kinds = (
        "deployments,daemonsets,services,configmaps,secrets,serviceaccounts,roles,rolebindings,"
        "poddisruptionbudgets,pods"
    )
    result = cluster.kubectl("-n", NAMESPACE, "get", kinds, "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name")
    cluster_wide = cluster.kubectl(
        "get", "clusterroles,clusterrolebindings,mutatingwebhookconfigurations",
        "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name",
    )  # fmt: skip
    return (result.stdout + cluster_wide.stdout).split()


@pytest.fixture
def helm(restored: LocalCluster, extender_image: Path, node_image: Path, tmp_path: Path) -> Iterator[Helm]:
    """The cluster as a managed one: its kube-scheduler stock, its extender process stopped (the chart's
    takes its port and Lease), its node daemon stopped and the node labelled for the chart's DaemonSet.
    Afterwards the release is gone, the host's daemon back, and the cluster's RBAC applied again."""
    cluster = restored
    cluster.stop("gpushared")  # its MPS control daemons keep running, as on a node; it adopts them again
    cluster.kubectl("label", "node", NODE, f"{DAEMONSET_LABEL}=daemonset", "--overwrite")
    shared = [Path("/run/gpushared"), daemonset_mps_root(cluster)]
    for path in shared:
        make_shared(path)
    version = cluster.version("kube-scheduler")
    image = f"localhost/gpushared/kube-scheduler:{version}"
    cluster.node.import_image(build_binary_image(tmp_path, cluster.bin / "kube-scheduler", image))
    cluster.stop("gpushared-extender")
    cluster.scheduling.restart_scheduler(extenders=False)
    helm = Helm(
        cluster,
        {
            "version": str(version),
            "extender_url": f"https://127.0.0.1:{cluster.ports.extender}",
            "extender_port": cluster.ports.extender,
            "apiserver_port": cluster.ports.apiserver,
            "secure_port": free_port(),
            "health_port": free_port(),
        },
    )
    try:
        yield helm
    finally:
        helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s", check=False)
        cluster.kubectl("-n", NAMESPACE, "delete", "pod", TEST_POD, "--ignore-not-found", "--wait=false", check=False)
        cluster.kubectl("label", "node", NODE, f"{DAEMONSET_LABEL}-", check=False)
        wait_for(lambda: not kube_pods(cluster, "app=gpushared-node"), timeout=90, what="the node daemon's pod gone")
        for path in shared:  # and the MPS shm mounts the pod's daemon left on the host with them
            subprocess.run(["umount", "--recursive", "--lazy", path], capture_output=True, check=False)
        cluster.bootstrap_rbac()
        cluster.node.start_daemon()
        cluster.node.wait_ready()


def make_shared(path: Path) -> None:
    """``path`` as a shared mount, as systemd leaves every mount of a node (``/`` is shared there; here it is
    not): the DaemonSet's bidirectional mounts need it, and the kubelet refuses them otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", path, path], check=True)
    subprocess.run(["mount", "--make-shared", path], check=True)


def daemonset_mps_root(cluster: LocalCluster) -> Path:
    """The DaemonSet's MPS root: its own, beside the host daemon's (whose control daemons live on)."""
    return cluster.state / "mps-daemonset"


def kube_pods(cluster: LocalCluster, selector: str) -> list[str]:
    return cluster.kubectl("-n", NAMESPACE, "get", "pods", "-l", selector, "-o", "name").stdout.split()


def node_daemonset_values(cluster: LocalCluster, image_version: str) -> list[str]:
    """The chart's DaemonSet on this node: the image built here; the fake GPUs as a driver would show
    them, through the chart's own driver-root mount (the fake libnvidia-ml.so.1 where a driver puts it,
    the real nvidia-cuda-mps-control beside it) and dev root; MPS on, under an MPS root of its own."""
    gpus = cluster.gpus
    driver_root = cluster.state / "driver-root"
    library = driver_root / "usr" / "lib" / "x86_64-linux-gnu" / "libnvidia-ml.so.1"
    library.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(gpus.file.parent / "libnvidia-ml.so.1", library)
    control = driver_root / "usr" / "bin" / "nvidia-cuda-mps-control"
    control.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(fetch_mps_control(cluster.mps_cache), control)
    gpus.make_device_nodes(gpus.gpu_count())
    nvml, mps = str(gpus.file.parent), str(daemonset_mps_root(cluster))
    values = {
        "enabled": True,
        "image": {"repository": "localhost/gpushared-node", "tag": image_version},
        "kubeletDir": str(KUBELET_ROOT),
        "driverRoot": str(driver_root),
        "devRoot": str(gpus.dev_root),
        "config": {
            "memoryUnit": "GiB",
            "metrics": {"port": free_port(), "address": "127.0.0.1"},
            "mps": {"enabled": True, "root": mps, "probeSeconds": 1},
        },
        "extraEnv": [{"name": "FAKE_NVML_CONFIG", "value": str(gpus.file)}],
        "extraVolumes": [
            {"name": "fake-nvml", "hostPath": {"path": nvml, "type": "Directory"}},
            {"name": "mps-root", "hostPath": {"path": mps, "type": "DirectoryOrCreate"}},
        ],
        "extraVolumeMounts": [
            {"name": "fake-nvml", "mountPath": nvml, "readOnly": True},
            {"name": "mps-root", "mountPath": mps, "mountPropagation": "Bidirectional"},
        ],
    }
    return ["--set-json", f"node.daemonset={json.dumps(values)}"]


def test_helm_install_test_upgrade_and_uninstall(helm: Helm, kube: Kube, namespace: str) -> None:
    cluster = helm.cluster
    version = cluster.version("kube-scheduler")
    helm.deploy(
        "install",
        "--take-ownership",
        "--set", "extender.replicas=1",  # one node: one host port
        "--set", "scheduler.replicas=1",
        "--set", "scheduler.image.repository=localhost/gpushared/kube-scheduler",  # the tag: the cluster's
        *node_daemonset_values(cluster, __version__),
    )  # fmt: skip
    wait_for_leader(kube, cluster)
    # The node daemon runs from its image: the node's gpu-mem comes from it, with its pod's own token.
    cluster.node.wait_ready()

    def started() -> dict[str, Any] | None:
        (pod,) = kube.pods(NAMESPACE, "app=gpushared-node")
        return pod if ready(pod) else None  # its readiness probe (/healthz) passed

    try:
        daemon = wait_for(started, timeout=60, what="the node daemon's pod Ready")
    except ClusterError:
        looks = [("describe", "pod", "-l", "app=gpushared-node"), ("logs", "-l", "app=gpushared-node", "--tail", "40")]
        seen = "\n".join(cluster.kubectl("-n", NAMESPACE, *look, check=False).stdout for look in looks)
        pytest.fail(f"the node daemon's pod is not Ready:\n{seen}")
    daemon_log = lambda: cluster.kubectl("-n", NAMESPACE, "logs", daemon["metadata"]["name"]).stdout  # noqa: E731
    assert "the pod's service account" in daemon_log()
    # MPS control daemons started in the same container, one per GPU, under the node's MPS root.
    mps_root = daemonset_mps_root(cluster)
    wait_for(lambda: len(host.mps_daemons(mps_root)) == cluster.gpus.gpu_count(), timeout=60,
             what="an MPS control daemon per GPU from the DaemonSet's daemon")  # fmt: skip
    # The chart chose what this version runs: its configuration API and kube-scheduler of its own version.
    config = cluster.kubectl("-n", NAMESPACE, "get", "configmap", "gpushared-scheduler", "-o", "json")
    assert f"apiVersion: {scheduler_api(version).api_version}" in json.loads(config.stdout)["data"]["config.yaml"]
    (scheduler,) = kube.pods(NAMESPACE, "app=gpushared-scheduler")
    assert scheduler["spec"]["containers"][0]["image"].endswith(f":{version}")

    # helm test: the binpack sample, placed by gpushared-scheduler through the extender, given its GPU.
    helm.test()  # fails unless the pod Succeeded: it exits 1 without the GPU its annotations name

    # The webhook: a GPU pod created as any tenant creates it goes to the second scheduler.
    created = kube.create(namespace, gpu_pod("via-webhook", 3))
    assert created["spec"]["schedulerName"] == "gpushared-scheduler"
    (pod,) = kube.wait_running(namespace, "via-webhook", timeout=120)
    index, uuid = gpu_of(kube, pod)
    env = kube.env_of(namespace, "via-webhook")
    assert env["NVIDIA_VISIBLE_DEVICES"] == uuid, index
    assert env["DEVICES"].split() == ["nvidia-uvm", f"nvidia{index}", "nvidiactl"]  # device specs from the pod
    assert f"Allocate: pod {namespace}/via-webhook" in daemon_log()  # the DaemonSet's daemon answered
    assert_no_gpu_over_capacity(kube)

    # helm upgrade keeps certificates that are still good...
    before = secret_data(kube, "gpushared-extender-tls")
    ca_before = secret_data(kube, "gpushared-ca")
    helm.deploy("upgrade", "--reuse-values")
    assert secret_data(kube, "gpushared-extender-tls") == before
    # ...and issues them again inside the renewal window (here: the Secret says it expires in a minute),
    # from the same CA, so that every client keeps trusting the extender meanwhile.
    (extender_pod,) = kube.pods(NAMESPACE, "app=gpushared-extender")
    soon = str(int(time.time()) + 60)
    cluster.kubectl(
        "-n", NAMESPACE, "annotate", "--overwrite", "secret", "gpushared-extender-tls", f"gpushared.io/not-after={soon}"
    )  # fmt: skip
    helm.deploy("upgrade", "--reuse-values")
    after = secret_data(kube, "gpushared-extender-tls")
    assert after["tls.crt"] != before["tls.crt"] and after["tls.key"] != before["tls.key"]
    assert secret_data(kube, "gpushared-ca") == ca_before and after["ca.crt"] == ca_before["tls.crt"]
    # The same extender pod serves the new certificate once the kubelet has refreshed the Secret's volume
    # (its sync period, about a minute) and the extender has read it (--tls-reload-seconds): no restart.
    port = cluster.ports.extender
    wait_for(lambda: served_certificate(port) == der(after["tls.crt"]), timeout=150, what="the new certificate served")
    (still,) = kube.pods(NAMESPACE, "app=gpushared-extender")
    assert still["metadata"]["uid"] == extender_pod["metadata"]["uid"]
    assert still["status"]["containerStatuses"][0]["restartCount"] == 0
    # kube-scheduler reads its client certificate once: the chart rolled it. Scheduling goes on.
    wait_for_leader(kube, cluster)
    helm.test()

    # helm uninstall leaves none of the release's objects.
    helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s")
    try:
        wait_for(lambda: not release_objects(cluster), timeout=90, what="every object of the release gone")
    except ClusterError:
        pytest.fail(f"left after helm uninstall: {release_objects(cluster)}")
    # The DaemonSet's MPS control daemons ended with its container.
    wait_for(lambda: not host.mps_daemons(mps_root), timeout=30, what="the pod's MPS control daemons gone")
