"""Where the local cluster lives and what it is called: paths, names, addresses, ports, identities.

Shared by the cluster (``tests.e2e.cluster``) and its parts (control plane, node, scheduling), and by
the tests, which import these names from ``tests.e2e.cluster``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness import free_port, poll

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUSHARED_K8S_CACHE", "/var/cache/gpushared/k8s-1.20.2"))
STATE = Path(os.environ.get("GPUSHARED_CLUSTER_DIR", "/var/tmp/gpushared-cluster"))
#: kubelet 1.20 hard-codes ``/var/lib/kubelet/device-plugins/``, so the root dir cannot move elsewhere.
KUBELET_ROOT = Path("/var/lib/kubelet")
KUBELET_LEFTOVERS = (KUBELET_ROOT, Path("/var/log/pods"), Path("/var/log/containers"))
NODE = "gpushared-node"
BRIDGE = "gps0"
#: kubelet refuses a loopback node IP, and the API server needs the node's address to fetch logs: an empty
#: bridge (no dummy module in every kernel) gives the node an address that exists on this machine only.
NODE_LINK, NODE_IP = "gps-node", "10.245.0.1"
POD_SUBNET = "10.244.0.0/24"
PAUSE_IMAGE = "localhost/gpushared/pause:3.2"
BUSYBOX_IMAGE = "docker.io/library/busybox:latest"
#: 16, 12, 24 and 8 GiB: different sizes, so a wrong GPU shows.
GPU_SIZES_MIB = (16384, 12288, 24576, 8192)

#: The identities in the static token file. The daemon and the extender authenticate as the ServiceAccounts
#: of deploy/, so the RBAC we ship is what the real API server enforces here.
USERS = {
    "admin": ("admin", "system:masters"),
    "gpushared-node": ("system:serviceaccount:kube-system:gpushared-node", "system:serviceaccounts"),
    "gpushared-extender": ("system:serviceaccount:kube-system:gpushared-extender", "system:serviceaccounts"),
    # the node's own identity (scripts/node-kubeconfig --node): what DRA nodes run as (tests/e2e/test_dra.py)
    "gpushared-node-own": (f"system:serviceaccount:kube-system:gpushared-node-{NODE}", "system:serviceaccounts"),
}


class ClusterError(Exception):
    pass


@dataclass
class Ports:
    etcd: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    scheduler_health: int
    kubelet: int
    kubelet_healthz: int
    extender: int
    daemon_metrics: int
    daemon_health: int = 0  # 0 (a cluster started before it was picked): no health port

    @classmethod
    def pick(cls) -> Ports:
        chosen: set[int] = set()
        values = []
        for _ in range(len(dataclasses.fields(cls))):
            port = free_port()
            while port in chosen:
                port = free_port()
            chosen.add(port)
            values.append(port)
        return cls(*values)


def wait_for(condition: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.2) -> Any:
    value = poll(condition, timeout=timeout, interval=interval)
    if value is None:
        raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
    return value
