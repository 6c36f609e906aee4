"""The extender benchmark's cluster: the fake or real API server, filled with busy GPU nodes and pending pods."""

from __future__ import annotations

import json
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import urllib3
import yaml

from gpushared.core.placement.binding import bind_annotations, holding_for
from gpushared.core.placement.policies import BINPACK
from gpushared.core.placement.pricing import PricingContext
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.requests import pod_request
from gpushared.core.shared.verdicts import judge
from tests.builders import inventory, pod
from tests.e2e.cluster import LocalCluster
from tests.extender_harness import gpu_node
from tests.fakes.apiserver import FakeApiServer

GPUS, GPU_GIB = 8, 16  # each node's GPUs, of 16 GiB each


class FakeBackend:
    """The fake API server, in this process: objects are stored without HTTP."""

    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.kubeconfig = Path(tempfile.mkdtemp(prefix="gps-bench-")) / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.api.create(body)

    def create_all(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.api.create(body) for body in bodies]


class RealBackend:
    """The real kube-apiserver and etcd of tests/e2e's local cluster; the extender authenticates as the
    ServiceAccount of deploy/, so the RBAC we ship is what the API server enforces."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.kubeconfig = cluster.kubeconfig_for("gpushared-extender")
        self.http = urllib3.PoolManager(maxsize=CREATORS, ca_certs=str(cluster.state / "pki" / "ca.crt"))
        self.headers = {"Authorization": f"Bearer {cluster.tokens['admin']}", "Content-Type": "application/json"}
        # Pod admission wants the namespace's default ServiceAccount, which no controller creates here.
        self._post("/api/v1/namespaces/default/serviceaccounts", {"metadata": {"name": "default"}})

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = self.http.request("POST", self.cluster.server + path, body=json.dumps(body), headers=self.headers)
        if answer.status >= 300:
            raise RuntimeError(f"POST {path}: {answer.status} {answer.data[:300]!r}")
        return json.loads(answer.data)  # type: ignore[no-any-return]

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        if body["kind"] == "Node":
            return self._post("/api/v1/nodes", body)  # a node's status may be set at creation
        return self._post(f"/api/v1/namespaces/{body['metadata']['namespace']}/pods", body)

    def create_all(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(CREATORS) as pool:
            return list(pool.map(self.create, bodies))


Backend = FakeBackend | RealBackend


#: Concurrent creations when filling the real API server.
CREATORS = 16


def populate(backend: Backend, *, nodes: int, pods: int, rng: random.Random) -> list[str]:
    """Nodes, and running pods placed by the extender's binpack; the node names."""
    names = [f"node-{i:05d}" for i in range(nodes)]
    inv = inventory(*[GPU_GIB] * GPUS)
    backend.create_all([gpu_node(name, inv=inv) for name in names])
    ledgers = {name: Ledger.build(inv) for name in names}
    bodies = []
    for i in range(pods):
        body = pod(f"run-{i:06d}", rng.randint(1, 4), node=None, phase="Running", uid=f"uid-run-{i:06d}")
        request = pod_request(body)
        for _ in range(20):
            node = names[rng.randrange(nodes)]
            # binpack, whatever policy is measured: the same cluster every run
            choice = BINPACK.choose(judge(ledgers[node], request), request, PricingContext(ledgers[node]))
            if choice is not None:
                break
        else:
            continue
        body["spec"]["nodeName"] = node
        body["spec"]["automountServiceAccountToken"] = False
        gpus = [verdict.gpu for verdict in choice]
        body["metadata"]["annotations"] = bind_annotations(request, gpus, unit=inv.unit, now_ns=i)
        ledgers[node].add(holding_for(request, gpus, uid=body["metadata"]["uid"], namespace="default", name=""))
        bodies.append(body)
    backend.create_all(bodies)
    return names


def pending_body(name: str, rng: random.Random) -> dict[str, Any]:
    body = pod(name, rng.randint(1, 8), uid=f"uid-{name}")
    body["spec"]["automountServiceAccountToken"] = False
    return body


def pending(backend: Backend, name: str, rng: random.Random) -> dict[str, Any]:
    return backend.create(pending_body(name, rng))
