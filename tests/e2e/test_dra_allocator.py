"""The claim allocator on a real cluster (Kubernetes >= 1.34: resource.k8s.io/v1), GPUs simulated (issue #54).

deploy/dra/claim-allocator.yaml applied (its webhook called at the extender's URL, as this cluster reaches it),
the extender run with ``--claim-allocator --policy binpack``: the webhook gates each new pod that names a
claim or template of gpushared's class, the leader allocates its claims and removes the gate, kube-scheduler
binds the pod to the allocation's node, and the daemon prepares the claims as any others. Skipped, saying
why, on the 1.20 Debian builds, like tests/e2e/test_dra.py, whose node in DRA mode these cases share.
"""

from __future__ import annotations

import base64
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gpushared.core.placement.admission import CLAIM_GATE
from tests.e2e.cluster import LocalCluster, wait_for
from tests.e2e.kube import Kube
from tests.e2e.test_dra import (
    DRA,
    NEEDS_DRA,
    allocations,
    apply,
    assert_no_gpu_over_capacity,
    claim_body,
    claim_pod,
    dra_node,
    slices,
    template_body,
)

__all__ = ["dra_node"]  # the node in DRA mode, the fixture this module's own builds on

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), NEEDS_DRA]


def allocator_objects(cluster: LocalCluster) -> list[dict[str, Any]]:
    """deploy/dra/claim-allocator.yaml, its webhook called at the extender's URL with the extender's CA."""
    docs = [d for d in yaml.safe_load_all((DRA / "claim-allocator.yaml").read_text()) if d]
    ca = base64.b64encode((cluster.scheduling.extender_certs / "ca.crt").read_bytes()).decode()
    for doc in docs:
        if doc["kind"] == "MutatingWebhookConfiguration":
            for webhook in doc["webhooks"]:
                client = webhook["clientConfig"]
                client["url"] = cluster.scheduling.extender_url + client.pop("service")["path"]
                client["caBundle"] = ca
    return docs


@pytest.fixture(scope="module")
def allocating(dra_node: LocalCluster) -> Iterator[LocalCluster]:
    cluster = dra_node
    objects = yaml.safe_dump_all(allocator_objects(cluster))
    cluster.kubectl("apply", "-f", "-", input=objects)
    cluster.scheduling.restart_extender("--claim-allocator", "--policy", "binpack")
    yield cluster
    cluster.kubectl("delete", "-f", "-", input=objects, check=False)
    cluster.scheduling.restart_extender()


def device_index(cluster: LocalCluster) -> dict[str, int]:
    """Device name -> GPU index, from the node's slice."""
    return {d["name"]: d["attributes"]["index"]["int"] for s in slices(cluster) for d in s["spec"]["devices"]}


def gates(kube: Kube, namespace: str, name: str) -> list[str]:
    return [g["name"] for g in kube.pod(namespace, name)["spec"].get("schedulingGates") or []]


def test_claims_first_fit_strands_are_placed(allocating: LocalCluster, kube: Kube, namespace: str) -> None:
    """On the 16, 12, 24 and 8 GiB GPUs, 8, 12, 24 then 16 GiB one after another: first fit puts the first on
    the 16 GiB GPU and leaves the last pending; binpack puts it on the 8 GiB one and all four run."""
    cluster = allocating
    for name, memory in (("a", "8Gi"), ("b", "12Gi"), ("c", "24Gi"), ("d", "16Gi")):
        apply(cluster, namespace, claim_body(name, memory), claim_pod(f"p-{name}", name))
        kube.wait_running(namespace, f"p-{name}", timeout=120)
        assert gates(kube, namespace, f"p-{name}") == []
    index = device_index(cluster)
    placed = {name: index[results[0]["device"]] for name, results in allocations(cluster, namespace).items()}
    assert placed == {"a": 3, "b": 1, "c": 2, "d": 0}
    assert_no_gpu_over_capacity(cluster)


def test_ten_claims_on_the_four_gpus_and_the_tenth_waits_gated(
    allocating: LocalCluster, kube: Kube, namespace: str
) -> None:
    """Ten 6 GiB claims fill the 16, 12, 24 and 8 GiB GPUs two, two, four and one at a time; the tenth's pod
    keeps its gate (fail closed: nothing is left to first fit) and says why in an Event."""
    cluster = allocating
    names = [f"c{i}" for i in range(10)]
    apply(cluster, namespace, *(claim_body(n, "6Gi") for n in names), *(claim_pod(f"p-{n}", n) for n in names))
    wait_for(
        lambda: sum(1 for r in allocations(cluster, namespace).values() if r) == 9, timeout=120, what="9 allocated"
    )
    time.sleep(3)
    allocated = allocations(cluster, namespace)
    (waiting,) = [n for n, r in allocated.items() if not r]
    assert gates(kube, namespace, f"p-{waiting}") == [CLAIM_GATE]
    kube.wait_event(namespace, f"p-{waiting}", lambda reason, message: reason == "WaitingForClaimAllocator")
    kube.wait_running(namespace, *(f"p-{n}" for n, r in allocated.items() if r), timeout=180)
    assert_no_gpu_over_capacity(cluster)


def test_a_template_and_an_mps_claim_through_the_allocator(
    allocating: LocalCluster, kube: Kube, namespace: str
) -> None:
    cluster = allocating
    apply(cluster, namespace, template_body("gpu-2gi", "2Gi"))
    time.sleep(2)  # the extender's book sees the template before the pod is created (else it is not gated)
    from_template = claim_pod("templated", "unused")
    from_template["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu-2gi"}]
    mps = claim_body("mps", "3Gi", compute="20", config={"mps": True, "computeLimit": 40})
    apply(cluster, namespace, mps)
    time.sleep(2)
    apply(cluster, namespace, from_template, claim_pod("mps-client", "mps"))
    kube.wait_running(namespace, "templated", "mps-client", timeout=120)
    claims = {c["name"]: c for c in cluster.node.daemon_status()["claims"]}
    assert claims["mps"]["devices"][0]["mps"] is True
    metrics = cluster.scheduling.extender_metrics()
    assert 'gpushared_extender_claim_pods_total{outcome="allocated"}' in metrics
    assert 'gpushared_extender_claim_pods_total{outcome="not_gated"} 0.0' in metrics


def test_two_linked_gpus(allocating: LocalCluster, kube: Kube, namespace: str) -> None:
    cluster = allocating
    domains = {
        d["name"]: d["attributes"].get("nvlinkDomain", {}).get("string")
        for s in slices(cluster)
        for d in s["spec"]["devices"]
    }
    if sum(1 for domain in domains.values() if domain) < 2:
        pytest.skip("the simulated GPUs of this node are not joined by NVLink")
    linked = claim_body("linked", "2Gi")
    linked["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    linked["spec"]["devices"]["constraints"] = [{"matchAttribute": "gpu.gpushared.io/nvlinkDomain"}]
    apply(cluster, namespace, linked, claim_pod("linked", "linked"))
    kube.wait_running(namespace, "linked", timeout=120)
    results = allocations(cluster, namespace)["linked"]
    assert len({domains[r["device"]] for r in results}) == 1 and len({r["device"] for r in results}) == 2


def test_the_leader_killed_during_allocations_allocates_each_claim_once(
    allocating: LocalCluster, kube: Kube, namespace: str
) -> None:
    cluster = allocating
    names = [f"k{i}" for i in range(6)]
    apply(cluster, namespace, *(claim_body(n, "2Gi") for n in names), *(claim_pod(f"p-{n}", n) for n in names))
    cluster.processes.stop("gpushared-extender", sig=signal.SIGKILL)
    cluster.scheduling.restart_extender("--claim-allocator", "--policy", "binpack")
    kube.wait_running(namespace, *(f"p-{n}" for n in names), timeout=180)
    allocated = allocations(cluster, namespace)
    assert all(len(allocated[n]) == 1 for n in names)
    assert_no_gpu_over_capacity(cluster)


def test_a_pod_deleted_while_gated_leaves_its_claim_unallocated(
    allocating: LocalCluster, kube: Kube, namespace: str
) -> None:
    cluster = allocating
    apply(cluster, namespace, claim_body("huge", "64Gi"), claim_pod("p-huge", "huge"))
    wait_for(lambda: gates(kube, namespace, "p-huge") == [CLAIM_GATE], timeout=30, what="gated")
    cluster.kubectl("-n", namespace, "delete", "pod", "p-huge", "--grace-period=0")
    time.sleep(3)
    assert not allocations(cluster, namespace)["huge"]
