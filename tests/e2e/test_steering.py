"""The steerer on a real cluster (``--steer-cpu-pods``; docs/dra.md, "Steering CPU-only pods"): its webhook
gates a CPU-only pod of a labelled namespace, the leader adds its preferred node affinity and removes the
gate in one JSON Patch (KEP-3838: a gated pod's affinity may change), and kube-scheduler binds the pod.
Scheduling gates are GA from Kubernetes 1.30: skipped, saying why, on older binaries.

A second node, created here with no GPUs and no kubelet (it leaves no GPU memory idle), is the one the
steerer prefers for a CPU-only pod: the real node's GPUs would sit idle beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.e2e.cluster import ROOT, LocalCluster, cached_version, wait_for
from tests.e2e.kube import Kube
from tests.e2e.manifests import at_extender

VERSION = cached_version("kube-apiserver")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        VERSION is None or (VERSION.major, VERSION.minor) < (1, 30),
        reason=f"scheduling gates are GA from Kubernetes 1.30; the harness's binaries are {VERSION}",
    ),
]

STEER = ROOT / "deploy" / "managed" / "steer.yaml"
GPU_LESS = "steer-cpu-only-node"


def steer_objects(cluster: LocalCluster) -> list[dict[str, Any]]:
    """deploy/managed/steer.yaml, its webhook called at the extender's URL with the extender's CA."""
    ca = (cluster.scheduling.extender_certs / "ca.crt").read_bytes()
    return at_extender(STEER, url=cluster.scheduling.extender_url, ca=ca)


def gpu_less_node() -> dict[str, Any]:
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": GPU_LESS, "labels": {"kubernetes.io/hostname": GPU_LESS}},
        "status": {
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "conditions": [ready],
        },
    }


@pytest.fixture
def steering(cluster: LocalCluster, kube: Kube, namespace: str) -> Iterator[LocalCluster]:
    objects = yaml.safe_dump_all(steer_objects(cluster))
    cluster.kubectl("apply", "-f", "-", input=objects)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(gpu_less_node()))
    cluster.kubectl("label", "namespace", namespace, "gpushared.io/steer=true")
    cluster.scheduling.restart_extender("--steer-cpu-pods")
    yield cluster
    cluster.kubectl("delete", "-f", "-", input=objects, check=False)
    cluster.kubectl("delete", "node", GPU_LESS, check=False)
    cluster.scheduling.restart_extender()


def test_a_cpu_only_pod_is_gated_steered_off_the_gpu_node_and_bound(
    steering: LocalCluster, kube: Kube, namespace: str
) -> None:
    cluster = steering
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "cpu-only"},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "c",
                    "image": "busybox",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sleep", "3600"],
                    "resources": {"requests": {"cpu": "100m", "memory": "16Mi"}},
                }
            ],
        },
    }
    # the webhook gates only while a leader holds the Lease: the first pods may pass before it does
    wait_for(lambda: "gpushared-extender" in cluster.kubectl("-n", "kube-system", "get", "lease").stdout, timeout=30,
             what="the extender's Lease")  # fmt: skip
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(pod))
    bound = wait_for(lambda: kube.pod(namespace, "cpu-only")["spec"].get("nodeName"), timeout=60, what="bound")
    body = kube.pod(namespace, "cpu-only")
    assert not body["spec"].get("schedulingGates")
    preferred = body["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    best = max(preferred, key=lambda term: term["weight"])
    assert best["preference"]["matchFields"][0]["values"] == [GPU_LESS], preferred
    assert bound == GPU_LESS
    metrics = cluster.scheduling.extender_metrics()
    assert 'gpushared_extender_steered_pods_total{outcome="steered"} 1.0' in metrics
