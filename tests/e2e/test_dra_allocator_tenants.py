"""The claim allocator against a hostile tenant, on a real cluster (Kubernetes >= 1.34; skipped, saying why,
before). A tenant's pods that reach kube-scheduler ungated with pending claims make the allocator hold back
room while kube-scheduler may be allocating them; one tenant must not be able to hold it for everyone.

The tenant removes the allocator's gate from its own pods (anyone who may update a pod may remove its
gates) and gives each a ``nodeSelector`` no node matches: kube-scheduler keeps them forever and never
allocates them. Meanwhile another tenant's ordinary pod is allocated by the allocator, and soon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from gpushared.core.placement.claims.gate import CLAIM_GATE
from tests.e2e.cluster import LocalCluster, wait_for
from tests.e2e.kube import Kube
from tests.e2e.test_dra import NEEDS_DRA, allocations, apply, assert_no_gpu_over_capacity, claim_body, claim_pod
from tests.e2e.test_dra_allocator import allocating, dra_node, gates

__all__ = ["allocating", "dra_node"]  # the fixtures this module's cases build on

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), NEEDS_DRA]

#: How often the tenant creates an unschedulable pod, and how many it makes before the other tenant's pod.
TENANT_EVERY_SECONDS = 2.0
TENANT_HEAD_START = 3


def ungated_unschedulable(cluster: LocalCluster, namespace: str, stop: threading.Event, made: list[str]) -> None:
    """Every TENANT_EVERY_SECONDS: a 1 GiB claim and its pod, which no node's labels match, its gate removed."""
    number = 0
    while not stop.is_set():
        name = f"t{number}"
        pod = claim_pod(f"p-{name}", name)
        pod["spec"]["nodeSelector"] = {"gpushared.io/no-such-node": "true"}
        apply(cluster, namespace, claim_body(name, "1Gi"), pod)
        cluster.kubectl(
            "-n", namespace, "patch", "pod", f"p-{name}", "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/schedulingGates"}]', check=False,
        )  # fmt: skip
        made.append(name)
        number += 1
        stop.wait(TENANT_EVERY_SECONDS)


@pytest.fixture
def tenant(kube: Kube, allocating: LocalCluster) -> Iterator[str]:
    name = f"tenant-{int(time.time()) % 100000}"
    kube.create_namespace(name)
    yield name
    kube.delete_namespace(name)


def test_a_tenants_unschedulable_ungated_pods_do_not_stop_another_tenants_pod(
    allocating: LocalCluster, kube: Kube, namespace: str, tenant: str
) -> None:
    cluster = allocating
    stop = threading.Event()
    made: list[str] = []
    worker = threading.Thread(target=ungated_unschedulable, args=(cluster, tenant, stop, made), daemon=True)
    worker.start()
    try:
        wait_for(lambda: len(made) >= TENANT_HEAD_START, timeout=60, what="the tenant's first pods")
        created = time.monotonic()
        apply(cluster, namespace, claim_body("ordinary", "4Gi"), claim_pod("p-ordinary", "ordinary"))
        wait_for(
            lambda: gates(kube, namespace, "p-ordinary") == [] and bool(allocations(cluster, namespace)["ordinary"]),
            timeout=60,
            interval=0.05,
            what="the ordinary pod allocated and ungated",
        )
        waited = time.monotonic() - created
    finally:
        stop.set()
        worker.join(timeout=30)
    print(f"ordinary pod allocated {waited:.2f} s after it was applied, with {len(made)} tenant pods made")
    kube.wait_running(namespace, "p-ordinary", timeout=120)
    # The tenant's pods reached kube-scheduler, which could place none of them: nothing of theirs is allocated.
    assert not any(allocations(cluster, tenant).values())
    assert all(gates(kube, tenant, f"p-{name}") != [CLAIM_GATE] for name in made[:-1])
    assert waited < 10, f"the ordinary pod waited {waited:.1f} s behind the tenant's pods"
    assert_no_gpu_over_capacity(cluster)
