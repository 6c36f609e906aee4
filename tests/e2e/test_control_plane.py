"""The control-plane side as operators set it up (docs/install.md): kubeadm's static pod beside
kube-scheduler, and the second scheduler with its webhook for managed clusters whose scheduler cannot
change. Each test follows the guide's steps that can run here (scripts/extender-certs,
scripts/node-kubeconfig, the shipped manifests with only the edits tests/e2e/manifests.py lists), then puts
the cluster back as the other tests expect it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from gpushared import contract
from tests.e2e.cluster import NODE, NODE_IP, ROOT, LocalCluster, build_binary_image, wait_for
from tests.e2e.kube import Kube, gpu_pod
from tests.e2e.manifests import Wiring, second_scheduler, static_extender
from tests.e2e.test_cluster import assert_no_gpu_over_capacity, gpu_of
from tests.harness import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def guide(cluster: LocalCluster, *argv: Any) -> None:
    """One of docs/install.md's commands, as an administrator runs it: kubectl on PATH, the admin context."""
    result = subprocess.run(
        [str(a) for a in argv], env={**os.environ, **cluster.env()}, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"{' '.join(map(str, argv))}: {result.stdout}{result.stderr}"


def ready(pod: dict[str, Any] | None) -> bool:
    conditions = {c["type"]: c["status"] for c in (pod or {}).get("status", {}).get("conditions", [])}
    return conditions.get("Ready") == "True"


def find(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return kube.pod(namespace, name)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def lease_holder(cluster: LocalCluster, name: str) -> str:
    result = cluster.kubectl("-n", "kube-system", "get", "lease", name, "-o", "json", check=False)
    return str(json.loads(result.stdout)["spec"].get("holderIdentity") or "") if result.returncode == 0 else ""


def scheduled_by(kube: Kube, namespace: str, name: str) -> set[str]:
    """Which scheduler reported placing the pod: its Scheduled event's reporting component."""
    events = kube.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return {e.reporting_component or e.source.component for e in events if e.reason == "Scheduled"}


def test_the_extender_as_a_static_pod_beside_kube_scheduler_over_loopback(
    kube: Kube, restored: LocalCluster, namespace: str, tmp_path: Path, extender_image: Path
) -> None:
    """kubeadm: deploy/control-plane/extender-static-pod.yaml in the kubelet's manifest directory, the certificates and
    kubeconfig the guide makes in its hostPath, and kube-scheduler calling https://127.0.0.1 with them."""
    cluster = restored
    etc = tmp_path / "etc-kubernetes-gpushared"  # the guide's /etc/kubernetes/gpushared
    guide(cluster, ROOT / "scripts" / "extender-certs", etc)
    guide(cluster, ROOT / "scripts" / "node-kubeconfig", "--extender", etc / "extender.kubeconfig")
    cluster.stop("gpushared-extender")
    manifest = cluster.static_pods / "gpushared-extender.yaml"
    mirror = f"gpushared-extender-{NODE}"
    try:
        manifest.write_text(yaml.safe_dump(static_extender(certs=etc, port=cluster.ports.extender)))
        wait_for(lambda: ready(find(kube, "kube-system", mirror)), timeout=120, what="the static extender Ready")
        # kube-scheduler with the guide's client certificate, calling the extender over loopback.
        cluster.scheduling.extender_certs = etc
        cluster.scheduling.restart_scheduler()
        kube.create(namespace, gpu_pod("via-static-pod", 3))
        (pod,) = kube.wait_running(namespace, "via-static-pod", timeout=120)
        index, uuid = gpu_of(kube, pod)
        assert kube.env_of(namespace, "via-static-pod")["NVIDIA_VISIBLE_DEVICES"] == uuid, index
        # It was the static pod that bound it: the Lease names the node (its identity, from spec.nodeName)
        # and the address it advertises (status.podIP, the node's on the host network).
        assert lease_holder(cluster, "gpushared-extender").startswith(f"{NODE} https://{NODE_IP}:")
        assert_no_gpu_over_capacity(kube)
    finally:
        manifest.unlink(missing_ok=True)
        wait_for(lambda: find(kube, "kube-system", mirror) is None, timeout=90, what="the static pod gone")
        wait_for(lambda: not cluster.scheduling.extender_ready(), timeout=60, what="the static extender stopped")


def test_a_second_scheduler_and_webhook_leave_the_default_scheduler_untouched(
    kube: Kube, restored: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    """Managed clusters: kube-scheduler stock (no extender), deploy/managed/gpushared-scheduler.yaml applied, the
    guide's certificates; a GPU pod goes through gpushared-scheduler, a CPU pod through the default one.
    With the extender stopped, failurePolicy Ignore lets every pod be created."""
    cluster = restored
    version = cluster.version("kube-scheduler")
    image = f"localhost/gpushared/kube-scheduler:{version}"
    cluster.node.import_image(build_binary_image(tmp_path, cluster.bin / "kube-scheduler", image))
    wiring = Wiring(
        version=version,
        extender_url=cluster.scheduling.extender_url,
        apiserver_port=cluster.ports.apiserver,
        secure_port=free_port(),
        health_port=free_port(),
    )
    docs = second_scheduler(image=image, wiring=wiring)
    shipped = yaml.safe_dump_all(docs)
    certs = tmp_path / "certs"
    try:
        cluster.kubectl("apply", "-f", "-", input=shipped)
        guide(cluster, ROOT / "scripts" / "extender-certs", "--apply", "--webhook", certs)
        cluster.scheduling.restart_extender(certs=certs)
        cluster.scheduling.restart_scheduler(extenders=False)  # what a managed cluster runs: no extender
        wait_for(
            lambda: any(ready(p) for p in kube.pods("kube-system", "app=gpushared-scheduler")),
            timeout=120,
            what="gpushared-scheduler Ready",
        )
        wait_for(lambda: lease_holder(cluster, "gpushared-scheduler"), timeout=60, what="its leader elected")

        kube.create(namespace, gpu_pod("gpu", 2))
        kube.create(namespace, gpu_pod("cpu", 0))
        gpu, cpu = kube.wait_running(namespace, "gpu", "cpu", timeout=120)
        assert gpu["spec"]["schedulerName"] == "gpushared-scheduler"
        assert cpu["spec"]["schedulerName"] == "default-scheduler"
        index, uuid = gpu_of(kube, gpu)  # the extender's bind wrote the choice; the kubelet gave that GPU
        assert kube.env_of(namespace, "gpu")["NVIDIA_VISIBLE_DEVICES"] == uuid, index
        assert contract.ALIYUN_GPU_MEM_IDX not in cpu["metadata"].get("annotations", {})
        assert scheduled_by(kube, namespace, "gpu") == {"gpushared-scheduler"}
        assert scheduled_by(kube, namespace, "cpu") == {"default-scheduler"}

        # failurePolicy Ignore: with the extender (and so the webhook) stopped, pods are still created.
        cluster.stop("gpushared-extender")
        kube.create(namespace, gpu_pod("cpu-while-down", 0))
        created = kube.create(namespace, gpu_pod("gpu-while-down", 2))
        assert created["spec"]["schedulerName"] == "default-scheduler"  # not sent on: nobody answered
        kube.wait_running(namespace, "cpu-while-down", timeout=120)

        # The default scheduler knows no gpushared annotation; the node's gpushared refuses to guess a GPU,
        # so the pod fails at admission instead of running on a GPU nobody counted.
        def refused() -> str | None:
            pod = kube.pod(namespace, "gpu-while-down")
            return pod["status"].get("reason") if pod["status"].get("phase") == "Failed" else None

        assert wait_for(refused, timeout=90, what="the unannotated GPU pod refused") == "UnexpectedAdmissionError"
        assert_no_gpu_over_capacity(kube)
    finally:
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=shipped, check=False)
        wait_for(lambda: not kube.pods("kube-system", "app=gpushared-scheduler"), timeout=90, what="the scheduler gone")
