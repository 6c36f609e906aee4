"""Multi-GPU pods on the best-linked GPUs, and the balanced policy, on the real cluster (issue #24).

The node's fake NVML is wired as a DGX-1 (hybrid cube-mesh NVLink, two sockets); the real daemon reads the
links through pynvml, the real kube-scheduler asks the extender, the real kubelet asks the daemon's
GetPreferredAllocation and Allocate, and the container's NVIDIA_VISIBLE_DEVICES is checked against the
layout.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import pytest

from gpushared import contract
from gpushared.core.shared.topology import LinkKind, set_score, topology_of
from tests.e2e.cluster import GPU_SIZES_MIB, LocalCluster, wait_for
from tests.e2e.kube import Kube, gpu_pod
from tests.fakes.topologies import layout

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

GIB = 16
DGX1 = layout("dgx1")


@pytest.fixture
def dgx1_node(kube: Kube, cluster: LocalCluster, namespace: str) -> Iterator[None]:
    """The node as a DGX-1 of 16 GiB GPUs, the extender on ``balanced``; both as before afterwards."""
    cluster.gpus.write_layout("dgx1", GIB * 1024)
    cluster.node.restart_daemon()
    cluster.scheduling.restart_extender("--policy", "balanced")
    wait_for(lambda: kube.allocatable() == 8 * GIB, timeout=60, what="the DGX-1 inventory")
    wait_for(lambda: topology_of(kube.inventory()).known, timeout=30, what="the links in the inventory")
    yield
    cluster.kubectl("-n", namespace, "delete", "pods", "--all", "--grace-period=2", "--wait=false")
    wait_for(lambda: not kube.pods(namespace), timeout=120, what="the DGX-1 pods to go", interval=0.5)
    cluster.gpus.write_gpus(GPU_SIZES_MIB)
    cluster.node.restart_daemon()
    cluster.scheduling.restart_extender()
    wait_for(lambda: kube.allocatable() == sum(GPU_SIZES_MIB) // 1024, timeout=60, what="the GiB inventory")


def visible_gpus(kube: Kube, namespace: str, name: str) -> list[int]:
    """The GPUs the container sees, by NVML index, from the UUIDs the kubelet gave it."""
    index = {gpu.uuid: gpu.index for gpu in kube.inventory().gpus}
    return sorted(index[uuid] for uuid in kube.env_of(namespace, name)["NVIDIA_VISIBLE_DEVICES"].split(","))


def containers_per_gpu(kube: Kube, namespace: str) -> Counter[int]:
    """How many containers each GPU serves, from the pods' allocation annotations."""
    counts: Counter[int] = Counter()
    for body in kube.pods(namespace):
        allocation = contract.parse_allocation(body["metadata"]["annotations"][contract.POD_ALLOCATION])
        for container in allocation.containers:
            counts.update(share.index for share in container.gpus)
    return counts


@pytest.mark.usefixtures("dgx1_node")
def test_multi_gpu_pods_get_nvlinked_sets_and_balanced_evens_out_containers(
    kube: Kube, cluster: LocalCluster, namespace: str
) -> None:
    inventory = kube.inventory()
    assert [gpu.numa for gpu in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topology_of(inventory).matrix(list(range(8))) == DGX1.matrix(list(range(8)))

    taken: set[int] = set()
    for name, count in (("pair", 2), ("quad", 4)):
        body = gpu_pod(name, count * GIB // 2)
        body["spec"]["containers"][0]["resources"]["limits"][contract.DEFAULT_RESOURCES.gpu_count] = str(count)
        kube.create(namespace, body)
        kube.wait_running(namespace, name)
        seen = visible_gpus(kube, namespace, name)
        assert len(seen) == count
        assert all(DGX1.link(a, b).kind is LinkKind.NVLINK for a, b in itertools.combinations(seen, 2)), seen
        # Every GPU still had half its memory free for this pod: no set of `count` was better linked.
        assert set_score(seen, DGX1) == max(set_score(s, DGX1) for s in itertools.combinations(range(8), count))
        taken |= set(seen)

    # Fractional pods under balanced: each goes to the GPU serving the fewest containers.
    for i, size in enumerate((2, 1, 3, 2, 1, 2, 1, 2, 1, 3)):
        kube.create(namespace, gpu_pod(f"small-{i}", size))
    kube.wait_running(namespace, *[f"small-{i}" for i in range(10)])
    counts = containers_per_gpu(kube, namespace)
    assert sum(counts.values()) == 2 + 4 + 10
    assert max(counts[gpu] for gpu in range(8)) - min(counts[gpu] for gpu in range(8)) <= 1, counts
