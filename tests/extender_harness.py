"""Run the real ``gpushared-extender`` process against the fake API server and talk to it as kube-scheduler."""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpushared import contract
from gpushared.contract import GpuInventory
from gpushared.extender.cache import ClusterCache
from tests.builders import inventory
from tests.fakes.apiserver import FakeApiServer
from tests.harness import free_port, wait_until

PREFIX = "/gpushare-scheduler"


def gpu_node(
    name: str, *sizes: int, address: str = "10.0.0.1", inv: GpuInventory | None = None, cpu: str | None = None
) -> dict[str, Any]:
    """A node as the gpushared daemon leaves it: inventory annotation and gpu-count capacity (and, given
    ``cpu``, the allocatable CPU that kubelet reports)."""
    inv = inv or inventory(*sizes)
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": {contract.NODE_INVENTORY: contract.format_inventory(inv)}},
        "status": {
            "capacity": {
                contract.DEFAULT_RESOURCES.gpu_mem: str(inv.total),
                "aliyun.com/gpu-count": str(len(inv.gpus)),
            },
            "addresses": [{"type": "InternalIP", "address": address}],
        },
    }
    if cpu is not None:
        node["status"]["allocatable"] = {"cpu": cpu}
    return node


def fed_by_hand(**options: Any) -> ClusterCache:
    """A cache whose informers never list: the tests call their handlers with the objects themselves."""
    return ClusterCache(
        list_nodes=lambda **_: None, list_pods=lambda **_: None, resources=contract.DEFAULT_RESOURCES, **options
    )


def lease_holder(api: FakeApiServer, namespace: str = "default") -> str:
    """Who holds the extenders' Lease ("" while no one does): its identity ends in the holder's URL."""
    lease = api.get("leases", "gpushared-extender", namespace)
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def aliyun_node(name: str, total: int, count: int) -> dict[str, Any]:
    """A node under Aliyun's device plugin: gpu-mem capacity and gpu-count, no inventory annotation."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"capacity": {contract.DEFAULT_RESOURCES.gpu_mem: str(total), "aliyun.com/gpu-count": str(count)}},
    }


def cpu_node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "status": {}}


def gpushared_cluster(api: FakeApiServer) -> None:
    """n1 (gpushared, 16 + 8 GiB), aliyun-node (Aliyun, 2 x 8 GiB), cpu-node (no GPUs)."""
    api.create(gpu_node("n1", 16, 8))
    api.create(aliyun_node("aliyun-node", 16, 2))
    api.create(cpu_node("cpu-node"))


@dataclass
class Extender:
    #: the API server it watches and binds through: the fake one, or (None) the one ``kubeconfig`` names
    api: FakeApiServer | None
    workdir: Path
    args: list[str] = field(default_factory=list)
    port: int = 0
    process: subprocess.Popen[str] | None = None
    name: str = "extender"
    kubeconfig: Path | None = None
    #: the CPUs the process (and every thread it starts) may run on; None: any
    cpus: set[int] | None = None
    #: where it runs: a source tree whose gpushared package it runs instead of this one (scripts/ab_extender.py)
    cwd: Path | None = None
    #: HTTPS: the CA its certificate is checked against, and the client certificate (cert, key) to present
    ca: Path | None = None
    client: tuple[Path, Path] | None = None

    def start(self, *extra: str) -> Extender:
        kubeconfig = self.kubeconfig or self.workdir / "kubeconfig"
        if self.api is not None:
            kubeconfig.write_text(yaml.safe_dump(self.api.kubeconfig()))
        self.port = self.port or free_port()
        log = (self.workdir / f"{self.name}.log").open("a")
        # taskset (util-linux), so every thread the extender starts inherits the CPUs
        pinned = [] if self.cpus is None else ["taskset", "--cpu-list", ",".join(map(str, sorted(self.cpus)))]
        self.process = subprocess.Popen(
            [
                *pinned,
                sys.executable,
                "-m",
                "gpushared.cli.extender",
                "--address",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--kubeconfig",
                str(kubeconfig),
                "--log-level",
                "debug",
                *self.args,
                *extra,
                # on loopback, without client certificates unless the test gives a CA: bind anyway (a tree
                # older than the flag, in scripts/ab_extender.py, binds without it)
                *(
                    ["--insecure-bind"]
                    if not {"--client-ca", "--no-insecure-bind"} & set(self.args) and self._knows_insecure_bind()
                    else []
                ),
            ],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=self.cwd,
        )
        return self

    def _knows_insecure_bind(self) -> bool:
        source = Path(self.cwd or Path(__file__).resolve().parents[1]) / "gpushared" / "cli" / "extender.py"
        return not source.exists() or "--insecure-bind" in source.read_text()

    def wait_ready(self, timeout: float = 20) -> None:
        wait_until(lambda: self.get("/readyz")[0] == 200, timeout=timeout, message=f"{self.name} ready")

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(15)

    def log(self) -> str:
        path = self.workdir / f"{self.name}.log"
        return path.read_text() if path.exists() else ""

    def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        connection: http.client.HTTPConnection
        if self.ca is not None:
            context = ssl.create_default_context(cafile=str(self.ca))
            if self.client is not None:
                context.load_cert_chain(str(self.client[0]), str(self.client[1]))
            connection = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=30, context=context)
        else:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        except (ConnectionError, OSError):
            return 0, b""
        finally:
            connection.close()

    def get(self, path: str) -> tuple[int, bytes]:
        return self._request("GET", path)

    def post(self, verb: str, body: Any) -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, data = self._request("POST", f"{PREFIX}/{verb}", raw)
        try:
            return status, json.loads(data)
        except json.JSONDecodeError:
            return status, data.decode(errors="replace")

    def filter(self, pod: dict[str, Any], *nodes: str) -> tuple[int, Any]:
        return self.post("filter", {"Pod": pod, "NodeNames": list(nodes), "Nodes": None})

    def bind(self, pod: dict[str, Any], node: str) -> tuple[int, Any]:
        meta = pod["metadata"]
        return self.post(
            "bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}
        )

    def inspect(self, node: str | None = None) -> tuple[int, Any]:
        status, data = self.get(f"{PREFIX}/inspect" + (f"/{node}" if node else ""))
        return status, json.loads(data)
