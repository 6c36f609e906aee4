"""The claim allocator on a real cluster (Kubernetes >= 1.34: resource.k8s.io/v1), GPUs simulated (issue #54).

deploy/dra/claim-allocator.yaml applied (its webhook called at the extender's URL, as this cluster reaches it),
the extender run with ``--claim-allocator --policy binpack``: the webhook gates each new pod that names a
claim or template of gpushared's class, the leader allocates its claims and removes the gate, kube-scheduler
binds the pod to the allocation's node, and the daemon prepares the claims as any others. Skipped, saying
why, on the 1.20 Debian builds, like tests/e2e/test_dra.py, whose node in DRA mode these cases share.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gpushared.core.placement.claims.gate import CLAIM_GATE
from tests.e2e.cluster import LocalCluster, wait_for
from tests.e2e.kube import Kube
from tests.e2e.manifests import at_extender
from tests.e2e.test_dra import (
    DRA,
    NEEDS_DRA,
    allocations,
    apply,
    assert_no_gpu_over_capacity,
    claim_body,
    claim_pod,
    claims_pod,
    containerd_applies_cdi,
    dra_node,
    get,
    slices,
    template_body,
    told_every_gpu,
)

__all__ = ["dra_node"]  # the node in DRA mode, the fixture this module's own builds on

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), NEEDS_DRA]


def allocator_objects(cluster: LocalCluster) -> list[dict[str, Any]]:
    """deploy/dra/claim-allocator.yaml, its webhook called at the extender's URL with the extender's CA."""
    ca = (cluster.scheduling.extender_certs / "ca.crt").read_bytes()
    return at_extender(DRA / "claim-allocator.yaml", url=cluster.scheduling.extender_url, ca=ca)


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


def claims_allocated(cluster: LocalCluster) -> list[str]:
    """The claims of any namespace allocated now. A namespace is deleted once its pods are gone (conftest),
    and its claims only later, by the namespace controller: a case whose GPUs must be free waits for them."""
    found = json.loads(cluster.kubectl("get", "resourceclaims", "-A", "-o", "json").stdout)["items"]
    return [c["metadata"]["name"] for c in found if (c.get("status") or {}).get("allocation")]


def gates(kube: Kube, namespace: str, name: str) -> list[str]:
    return [g["name"] for g in kube.pod(namespace, name)["spec"].get("schedulingGates") or []]


def allocated_count(cluster: LocalCluster) -> float:
    """The extender's count of pods whose claims its allocator allocated."""
    for line in cluster.scheduling.extender_metrics().splitlines():
        if line.startswith('gpushared_extender_claim_pods_total{outcome="allocated"}'):
            return float(line.split()[-1])
    return 0.0


def assert_gated_not_handed_over(cluster: LocalCluster, kube: Kube, namespace: str, name: str) -> None:
    """The pod reached kube-scheduler through the allocator: no ClaimsNotGated Event on it (the allocator
    writes one, a moment later, for a pod that reached kube-scheduler ungated), none counted."""
    time.sleep(3)
    reasons = [reason for reason, _ in kube.events(namespace, name)]
    assert "ClaimsNotGated" not in reasons, reasons
    assert 'gpushared_extender_claim_pods_total{outcome="not_gated"} 0.0' in cluster.scheduling.extender_metrics()


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
    """The node's GPUs are two NVLink pairs, 0-2 (16 and 24 GiB) and 1-3 (12 and 8 GiB: tests/e2e/gpus.py).
    Two linked GPUs of 2 GiB each: kube-scheduler's first fit would take GPUs 0 and 2, the first device and
    the next of its domain; binpack takes the pair with the least room, 1 and 3."""
    cluster = allocating
    wait_for(lambda: not claims_allocated(cluster), timeout=120, what="the claims of earlier tests deleted")
    domains = {
        d["name"]: d["attributes"].get("nvlinkDomain", {}).get("string")
        for s in slices(cluster)
        for d in s["spec"]["devices"]
    }
    index = device_index(cluster)
    by_index = {index[name]: domain for name, domain in domains.items()}
    assert by_index[0] == by_index[2] != by_index[1] == by_index[3], by_index
    assert None not in by_index.values(), by_index
    linked = claim_body("linked", "2Gi")
    linked["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    linked["spec"]["devices"]["constraints"] = [{"matchAttribute": "gpu.gpushared.io/nvlinkDomain"}]
    apply(cluster, namespace, linked, claim_pod("linked", "linked"))
    kube.wait_running(namespace, "linked", timeout=120)
    results = allocations(cluster, namespace)["linked"]
    assert len({domains[r["device"]] for r in results}) == 1 and len({r["device"] for r in results}) == 2
    assert sorted(index[r["device"]] for r in results) == [1, 3]


def test_a_manifest_of_a_claim_and_its_pod_applied_whole(allocating: LocalCluster, kube: Kube, namespace: str) -> None:
    """How users write it: the claim and the pod in one file, one `kubectl apply -f`. The pod is created a
    moment after the claim, and is gated and allocated all the same: 8 GiB goes to the 8 GiB GPU, 3 (best
    fit), where kube-scheduler's first fit would take GPU 0."""
    cluster = allocating
    apply(cluster, namespace, claim_body("whole", "8Gi"), claim_pod("whole", "whole"))
    kube.wait_running(namespace, "whole", timeout=120)
    (result,) = allocations(cluster, namespace)["whole"]
    assert device_index(cluster)[result["device"]] == 3
    assert_gated_not_handed_over(cluster, kube, namespace, "whole")


def test_a_pod_of_a_template_is_gated_and_allocated(allocating: LocalCluster, kube: Kube, namespace: str) -> None:
    """A template and the pod that uses it, in one `kubectl apply`: the resourceclaim controller makes the
    claim only once the pod exists, so the allocator finds the pod gated before its claim; it allocates the
    claim when it is made (8 GiB: GPU 3, best fit) and kube-scheduler binds the pod there."""
    cluster = allocating
    before = allocated_count(cluster)
    pod = claim_pod("templated-8", "unused")
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu-8gi"}]
    apply(cluster, namespace, template_body("gpu-8gi", "8Gi"), pod)
    (running,) = kube.wait_running(namespace, "templated-8", timeout=120)
    (status,) = running["status"]["resourceClaimStatuses"]
    claim = get(cluster, "-n", namespace, "resourceclaim", status["resourceClaimName"])
    assert [o["uid"] for o in claim["metadata"]["ownerReferences"]] == [running["metadata"]["uid"]]
    (result,) = allocations(cluster, namespace)[status["resourceClaimName"]]
    assert device_index(cluster)[result["device"]] == 3
    assert allocated_count(cluster) == before + 1
    assert_gated_not_handed_over(cluster, kube, namespace, "templated-8")


def test_a_container_with_two_claims_through_the_allocator(
    allocating: LocalCluster, kube: Kube, namespace: str
) -> None:
    """Two 6 GiB claims named by one container: binpack puts one on the 8 GiB GPU 3 and the other on the
    12 GiB GPU 1, and the container is told both (each claim's CDI spec names the other's GPU too)."""
    cluster = allocating
    if not containerd_applies_cdi(cluster):
        pytest.skip("no runtime here applies CDI specs (containerd < 1.7): nothing gives the container its env")
    apply(cluster, namespace, claim_body("first", "6Gi"), claim_body("second", "6Gi"))
    time.sleep(2)  # the extender's book sees the claims before the pod is created
    apply(cluster, namespace, claims_pod("both", "first", "second"))
    kube.wait_running(namespace, "both", timeout=120)
    assert told_every_gpu(cluster, kube, namespace, "both", ("first", "second")) == [1, 3]
    assert_gated_not_handed_over(cluster, kube, namespace, "both")


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
