"""Priority that frees a GPU for claims, on a real cluster (Kubernetes >= 1.34: resource.k8s.io/v1): the claim
allocator evicts, through the Eviction API, the lower-priority pods whose claims hold the room on one GPU,
holds the room, and allocates the preemptor's claim there once kube-controller-manager has deallocated
theirs. kube-scheduler itself preempts for no gated pod, and its dry run frees no device.

The node's GPUs are 16, 12, 24 and 8 GiB. Nine 6 GiB claims of priority-0 pods fill every 6 GiB slot there is
(2 + 2 + 4 + 1); a 10 GiB claim fits only once one of the two on the 16 GiB GPU goes. Skipped, saying why,
on the 1.20 Debian builds, like tests/e2e/test_dra_allocator.py, whose allocator these cases share.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.e2e.cluster import LocalCluster, wait_for
from tests.e2e.kube import Kube
from tests.e2e.test_dra import NEEDS_DRA, allocations, apply, assert_no_gpu_over_capacity, claim_body, claim_pod
from tests.e2e.test_dra_allocator import allocating, claims_allocated, device_index, dra_node, gates
from tests.e2e.test_preemption import HIGH, LOW, POLITE, priority_classes, with_priority

__all__ = ["allocating", "dra_node", "priority_classes"]  # the fixtures these cases use

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400), NEEDS_DRA]

LOWS = [f"low-{i}" for i in range(9)]


def nine_low_claims(cluster: LocalCluster, kube: Kube, namespace: str) -> dict[str, int]:
    """The nine 6 GiB claims and their priority-0 pods, running: pod -> the GPU its claim got."""
    wait_for(lambda: not claims_allocated(cluster), timeout=180, what="the GPUs free of earlier cases' claims")
    claims = [claim_body(f"c-{name}", "6Gi") for name in LOWS]
    pods = [with_priority(claim_pod(name, f"c-{name}"), LOW) for name in LOWS]
    apply(cluster, namespace, *claims, *pods)
    kube.wait_running(namespace, *LOWS, timeout=180)
    index = device_index(cluster)
    found = allocations(cluster, namespace)
    placed = {name: index[found[f"c-{name}"][0]["device"]] for name in LOWS}
    assert sorted(Counter(placed.values()).items()) == [(0, 2), (1, 2), (2, 4), (3, 1)]
    return placed


def alive(kube: Kube, namespace: str) -> set[str]:
    return {p["metadata"]["name"] for p in kube.pods(namespace) if not p["metadata"].get("deletionTimestamp")}


@pytest.mark.usefixtures("priority_classes")
def test_a_high_priority_claim_gets_the_gpu_its_one_victim_frees(
    allocating: LocalCluster, kube: Kube, namespace: str
) -> None:
    cluster = allocating
    placed = nine_low_claims(cluster, kube, namespace)
    started = time.monotonic()
    apply(cluster, namespace, claim_body("c-high", "10Gi"), with_priority(claim_pod("high", "c-high"), HIGH))
    kube.wait_running(namespace, "high", timeout=120)
    took = time.monotonic() - started
    index = device_index(cluster)
    assert index[allocations(cluster, namespace)["c-high"][0]["device"]] == 0
    gone = set(LOWS) - alive(kube, namespace)
    assert len(gone) == 1, f"evicted: {sorted(gone)}"
    victim = gone.pop()
    assert placed[victim] == 0, "the victim was not on the GPU the preemptor got"
    assert "Preempted" in {reason for reason, _ in kube.events(namespace, victim)}  # Events outlive the pod
    assert "Preempting" in {reason for reason, _ in kube.events(namespace, "high")}
    assert gates(kube, namespace, "high") == []
    metrics = cluster.scheduling.extender_metrics()
    assert 'gpushared_extender_claim_preemptions_total{outcome="evicted"} 1.0' in metrics
    assert_no_gpu_over_capacity(cluster)
    print(f"the preemptor ran {took:.1f} s after it was created")  # the bar: 30 s
    assert took < 60, f"the preemptor ran {took:.0f} s after it was created"


@pytest.mark.usefixtures("priority_classes")
def test_a_claim_pod_that_may_not_preempt_evicts_nothing(allocating: LocalCluster, kube: Kube, namespace: str) -> None:
    cluster = allocating
    nine_low_claims(cluster, kube, namespace)
    apply(cluster, namespace, claim_body("c-polite", "10Gi"), with_priority(claim_pod("polite", "c-polite"), POLITE))
    kube.wait_event(namespace, "polite", lambda reason, _: reason == "WaitingForClaimAllocator")
    time.sleep(12)  # past the grace before a preemption, and a retry
    assert alive(kube, namespace) >= set(LOWS)
    assert gates(kube, namespace, "polite") != []
