"""What gating at admission costs a pod that is not gpushared's, on a real cluster (Kubernetes >= 1.34;
skipped, saying why, before).

The webhook gates a pod whose claims it does not know yet: a manifest applied whole reaches the webhook
before the claim's watch event reaches the extender. A pod whose claim turns out to be another driver's is
ungated by the allocator as soon as it reads the claim. This measures how long such a pod is held, against
the same pod created once its claim is known (never gated).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.e2e.cluster import LocalCluster, wait_for
from tests.e2e.kube import Kube
from tests.e2e.test_dra import NEEDS_DRA, apply, claim_pod
from tests.e2e.test_dra_allocator import allocating, dra_node, gates

__all__ = ["allocating", "dra_node"]  # the fixtures this module's cases build on

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), NEEDS_DRA]

#: A DeviceClass of a driver no node publishes: its claims are never allocated, and never gpushared's.
OTHER_CLASS = "other.example.com"


def other_claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": OTHER_CLASS}}]}},
    }


def ungated_after(kube: Kube, namespace: str, name: str) -> float:
    """Seconds from now until the pod exists with no scheduling gate (polled every 20 ms)."""
    started = time.monotonic()

    def free() -> bool:
        try:
            return gates(kube, namespace, name) == []
        except Exception:
            return False  # not created yet

    wait_for(free, timeout=30, interval=0.02, what=f"pod {name} ungated")
    return time.monotonic() - started


def test_a_pod_of_another_driver_applied_with_its_claim_is_held_only_briefly(
    allocating: LocalCluster, kube: Kube, namespace: str
) -> None:
    cluster = allocating
    cluster.kubectl(
        "apply", "-f", "-",
        input=f"apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: {OTHER_CLASS}\nspec: {{}}\n",
    )  # fmt: skip
    try:
        held, known = measure(cluster, kube, namespace)
    finally:
        cluster.kubectl("delete", "deviceclass", OTHER_CLASS, check=False)
    print(
        "another driver's pod, applied with its claim: held "
        + ", ".join(f"{s:.2f}" for s in held)
        + " s; created after its claim was known: "
        + ", ".join(f"{s:.2f}" for s in known)
        + " s (each from kubectl apply's return)"
    )
    metrics = cluster.scheduling.extender_metrics()
    assert 'gpushared_extender_claim_pods_total{outcome="handover"} 0.0' in metrics
    assert max(held) < 5


def measure(cluster: LocalCluster, kube: Kube, namespace: str) -> tuple[list[float], list[float]]:
    held = []
    for number in range(5):
        name = f"whole-{number}"
        apply(cluster, namespace, other_claim(name), claim_pod(f"p-{name}", name))
        held.append(ungated_after(kube, namespace, f"p-{name}"))
    known = []
    for number in range(5):
        name = f"known-{number}"
        apply(cluster, namespace, other_claim(name))
        time.sleep(1.0)  # the extender's book has seen the claim: the webhook lets the pod through
        apply(cluster, namespace, claim_pod(f"p-{name}", name))
        known.append(ungated_after(kube, namespace, f"p-{name}"))
    return held, known
