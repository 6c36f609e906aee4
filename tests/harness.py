"""Run the real ``gpushared serve`` process against the fakes: API server, kubelet, NVML, systemd."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpushared import contract
from gpushared.contract import GpuInventory
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from tests.builders import on_gpus, pod
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.kubelet import ContainerAllocation, ContainerSpec, FakeKubelet, PodRef
from tests.fakes.nvml import FakeNvml
from tests.fakes.store import RESOURCES
from tests.fakes.systemd import NotifySocket

NODE = "node-1"
GPU_MEM = contract.DEFAULT_RESOURCES.gpu_mem


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    """One ``gpushared serve`` process and the world around it."""

    api: FakeApiServer
    kubelet: FakeKubelet
    nvml: FakeNvml
    notify: NotifySocket
    workdir: Path
    config: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[str] | None = None
    metrics_port: int = 0
    health_port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    #: argv before the daemon's own: e.g. ``unshare --mount`` for the mount namespace systemd's sandbox gives it
    launcher: list[str] = field(default_factory=list)

    @property
    def config_path(self) -> Path:
        return self.workdir / "config.yaml"

    @property
    def log_path(self) -> Path:
        return self.workdir / "daemon.log"

    def write_config(self, **overrides: Any) -> None:
        kubeconfig = self.workdir / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(self.api.kubeconfig()))
        self.metrics_port = self.metrics_port or free_port()
        self.health_port = self.health_port or free_port()
        body = {
            "nodeName": NODE,
            "kubeconfig": str(kubeconfig),
            "kubeletDir": str(self.kubelet.root),
            "logLevel": "debug",
            # the TCP port answers anyone, without names; the tests read the full status from the local socket
            "metrics": {
                "address": "127.0.0.1",
                "port": self.metrics_port,
                "healthPort": self.health_port,
                "socket": str(self.status_socket),
            },
            "health": {"recoverAfterSeconds": 2},
            # GPUs changed by a test are seen within half a second, not the default five
            "gpuPollSeconds": 0.5,
            # deviceNodes (the default) hands over the GPUs' files: stand-ins here, plain files, which the
            # daemon finds and passes but makes no /dev/char links for (they are not character devices)
            "devRoot": str(self.dev_root()),
        }
        body.update(self.config)
        body.update(overrides)
        self.config_path.write_text(yaml.safe_dump(body))

    def dev_root(self, gpus: int = 16) -> Path:
        """A dev root with the files the driver makes: ``nvidia<N>`` for N < ``gpus``, and nvidiactl, nvidia-uvm."""
        root = self.workdir / "dev-root"
        (root / "dev").mkdir(parents=True, exist_ok=True)
        for name in [f"nvidia{n}" for n in range(gpus)] + ["nvidiactl", "nvidia-uvm"]:
            (root / "dev" / name).touch()
        return root

    def start(self, *args: str, watchdog_usec: int = 400_000) -> None:
        if not self.config_path.exists():
            self.write_config()
        env = {
            **os.environ,
            **self.nvml.env(),
            "NOTIFY_SOCKET": str(self.notify.path),
            "WATCHDOG_USEC": str(watchdog_usec),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        log = self.log_path.open("a")
        self.process = subprocess.Popen(
            [
                *self.launcher,
                sys.executable,
                "-m",
                "gpushared.cli.daemon",
                "serve",
                "--config",
                str(self.config_path),
                *args,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def turns(self, n: int = 2, timeout: float = 10) -> None:
        """Wait until the daemon's main loop has run ``n`` more times: each turn feeds the watchdog (every
        0.2 s under the harness's WATCHDOG_USEC), so what one turn would have acted on is acted on. The
        exact replacement for sleeping and then checking that nothing happened."""
        seen = len(self.notify.times("WATCHDOG=1"))
        wait_until(lambda: len(self.notify.times("WATCHDOG=1")) >= seen + n, timeout=timeout, message="loop turns")

    def stop(self, timeout: float = 10) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def wait_exit(self, timeout: float = 15) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    @property
    def status_socket(self) -> Path:
        return self.kubelet.root / "gpushared-status.sock"  # short: a unix socket's path has 107 bytes at most

    def status(self) -> dict[str, Any]:
        """The full status, as `gpushared status` reads it (the local socket: names included)."""
        from gpushared.daemon.endpoints import get_local

        return json.loads(get_local(self.status_socket, "/status"))  # type: ignore[no-any-return]

    def metrics_text(self) -> str:
        from gpushared.daemon.endpoints import get_local

        return get_local(self.status_socket, "/metrics").decode()

    def public(self, path: str) -> tuple[int, bytes]:
        """What anyone on the network gets from the TCP port."""
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    # --- the cluster side ---------------------------------------------------------------------------------

    def inventory_annotations(self) -> dict[str, str]:
        node = self.api.get("nodes", NODE) or {}
        return dict((node.get("metadata") or {}).get("annotations") or {})

    def inventory(self) -> GpuInventory:
        node = self.api.get("nodes", NODE)
        assert node is not None
        return contract.parse_inventory(node["metadata"]["annotations"][contract.NODE_INVENTORY])

    def place(
        self, name: str, *amounts: int, gpu: int | list[int], init: list[dict[str, Any]] | None = None, **kw: Any
    ) -> dict[str, Any]:
        """A pod as the extender leaves it: annotated for GPU ``gpu`` (a list: its first container spread
        over those GPUs with gpu-count) and bound to the node."""
        body = pod(name, *amounts, init=init, **kw)
        if isinstance(gpu, list):
            on_gpus(body, len(gpu))
        inventory = self.inventory()
        request = pod_request(body)
        chosen = [inventory.gpus[i] for i in (gpu if isinstance(gpu, list) else [gpu])]
        body["metadata"]["annotations"].update(
            bind_annotations(request, chosen, unit=inventory.unit, now_ns=time.time_ns())
        )
        body["spec"]["nodeName"] = NODE
        return self.api.create(body)

    def unplaced(self, name: str, *amounts: int) -> dict[str, Any]:
        body = pod(name, *amounts)
        body["spec"]["nodeName"] = NODE
        return self.api.create(body)

    def admit(self, body: dict[str, Any], *, between: Callable[[str], None] | None = None) -> list[ContainerAllocation]:
        meta = body["metadata"]
        containers = [
            ContainerSpec(c["name"], _amount(c), init=True, sidecar=c.get("restartPolicy") == "Always")
            for c in body["spec"].get("initContainers") or []
        ] + [ContainerSpec(c["name"], _amount(c)) for c in body["spec"]["containers"]]
        current = self.api.get("pods", meta["name"], meta["namespace"])
        assert current is not None
        return self.kubelet.admit(
            PodRef(current["metadata"]["uid"], meta["name"], meta["namespace"]), GPU_MEM, containers, between=between
        )

    def events(self, name: str) -> list[tuple[str, str]]:
        return [(e["reason"], e["message"]) for e in self.api.objects("events") if e["involvedObject"]["name"] == name]


def _amount(container: dict[str, Any]) -> int:
    return int(((container.get("resources") or {}).get("limits") or {}).get(GPU_MEM, 0))


def poll(condition: Callable[[], Any], *, timeout: float, interval: float) -> Any:
    """``condition()`` every ``interval`` seconds until it returns something true, which is returned; None
    once ``timeout`` seconds have passed (it is asked once more at the end)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def wait_until(condition: Any, *, timeout: float = 10, interval: float = 0.05, message: str = "") -> Any:
    value = poll(condition, timeout=timeout, interval=interval)
    if value is None:
        raise AssertionError(f"timed out waiting: {message}")
    return value


def node_body(name: str = NODE) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"gpushare": "true"}},
        "status": {},
    }


def uuids(allocations: Iterable[ContainerAllocation]) -> list[str]:
    return [a.response.envs["NVIDIA_VISIBLE_DEVICES"] for a in allocations]


TOTAL_UNITS = 16 + 12 + 24 + 8  # the default fake node's four GPUs, in GiB


def started(daemon: Daemon) -> Daemon:
    """Start the daemon and wait until it is ready, advertised to the kubelet, and its inventory published."""
    daemon.start()
    daemon.notify.wait_for("READY=1")
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS)
    wait_until(
        lambda: (
            contract.NODE_INVENTORY in (daemon.api.get("nodes", NODE) or {}).get("metadata", {}).get("annotations", {})
        ),
        message="inventory",
    )
    return daemon


def protect(
    api: FakeApiServer, *names: str, namespace: str = "default", label: tuple[str, str] = ("app", "notebook")
) -> None:
    """A PodDisruptionBudget that allows no disruption over the pods ``names``, which get its label."""
    key, value = label
    for name in names:
        body = api.get("pods", name, namespace)
        assert body is not None
        body["metadata"].setdefault("labels", {})[key] = value
        api.store.update(RESOURCES["pods"], namespace, name, body, subresource="", precondition_rv=None)
    if api.get("poddisruptionbudgets", f"{key}-{value}", namespace) is None:
        api.create(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": f"{key}-{value}", "namespace": namespace},
                "spec": {"selector": {"matchLabels": {key: value}}},
                "status": {"disruptionsAllowed": 0},
            }
        )
