"""The local cluster's one node: containerd with a bridge CNI network, kubelet, and the gpushared daemon on
the simulated GPUs (``tests.e2e.gpus``), each started, restarted and asked as a test needs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gpushared.daemon.endpoints import get_local
from tests.e2e import versions
from tests.e2e.images import build_busybox_image, build_pause_image
from tests.e2e.layout import (
    BRIDGE,
    KUBELET_ROOT,
    NODE,
    NODE_IP,
    NODE_LINK,
    PAUSE_IMAGE,
    POD_SUBNET,
    ClusterError,
    wait_for,
)
from tests.mps_binary import fetch_mps_control

if TYPE_CHECKING:
    from tests.e2e.cluster import LocalCluster


class Node:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    # --- containerd -----------------------------------------------------------------------------------------

    def start_containerd(self) -> None:
        c = self.cluster
        base = c.state / "containerd"
        net = c.state / "cni"
        (net / "net.d").mkdir(parents=True)
        (net / "net.d" / "10-gpushared.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": "gpushared",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            # No gateway, no masquerade: pods need no way out, and the host's forwarding
                            # and iptables stay as they were.
                            "isGateway": False,
                            "ipMasq": False,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_SUBNET}]],
                                "dataDir": str(net / "ipam"),
                            },
                        },
                        {"type": "loopback"},
                    ],
                }
            )
        )
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (base / "opt").mkdir(parents=True)
        (base / "config.toml").write_text(
            f"""version = 2
root = "{base}/root"
state = "{base}/state"
[grpc]
  address = "{c.containerd_socket}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # The sandbox lacks CAP_SYS_RESOURCE: without this runc cannot lower a container's oom_score_adj.
  restrict_oom_score_adj = true
  {versions.containerd_cdi(c.version("containerd"), spec_dirs=[str(c.cdi_root)])}
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{c.bin}/runc"
  Root = "{base}/runc"
[{cri}.cni]
  bin_dir = "{c.cni_bin}"
  conf_dir = "{net}/net.d"
"""
        )
        c.cdi_root.mkdir(exist_ok=True)  # before containerd, which watches it for specs (1.7+)
        c.processes.spawn("containerd", [c.bin / "containerd", "--config", base / "config.toml"])
        wait_for(lambda: self.ctr("version", check=False).returncode == 0, timeout=30, what="containerd")
        images = c.state / "images"
        images.mkdir()
        self.ctr("images", "import", build_pause_image(images))
        self.ctr("images", "import", build_busybox_image(images, c.bin / "busybox"))

    def ctr(self, *args: Any, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        c = self.cluster
        argv = [c.bin / "ctr", "--address", c.containerd_socket, "--namespace", "k8s.io", *args]
        return subprocess.run([str(a) for a in argv], capture_output=True, check=check)

    def remove_containers(self) -> None:
        """Kill and delete every container containerd runs for the kubelet."""
        tasks = self.ctr("tasks", "list", "--quiet", check=False).stdout.decode().split()
        for task in tasks:
            self.ctr("tasks", "kill", "--all", "--signal", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 10
        for task in tasks:
            while self.ctr("tasks", "delete", task, check=False).returncode != 0 and time.monotonic() < deadline:
                time.sleep(0.2)
        for container in self.ctr("containers", "list", "--quiet", check=False).stdout.decode().split():
            self.ctr("containers", "delete", container, check=False)

    def import_image(self, archive: Path) -> None:
        """An image archive (``docker save`` format, as ``make image`` exports) into the kubelet's containerd."""
        self.ctr("images", "import", archive)

    # --- kubelet -------------------------------------------------------------------------------------------

    def add_address(self) -> None:
        if shutil.which("ip") is None:
            raise ClusterError("the `ip` command is missing: apt-get install iproute2")
        for argv in (
            ["link", "add", NODE_LINK, "type", "bridge"],
            ["addr", "add", f"{NODE_IP}/32", "dev", NODE_LINK],
            ["link", "set", NODE_LINK, "up"],
        ):
            result = subprocess.run(["ip", *argv], capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise ClusterError(f"ip {' '.join(argv)}: {result.stderr.strip()}")

    def start_kubelet(self) -> None:
        c = self.cluster
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "port": c.ports.kubelet,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": c.ports.kubelet_healthz,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "makeIPTablesUtilChains": False,
            # Reachable from this machine only (NODE_IP): the API server fetches logs without credentials.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            # A developer machine's disk is often fuller than kubelet's defaults accept.
            "evictionHard": {"nodefs.available": "1%", "imagefs.available": "1%", "memory.available": "50Mi"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "staticPodPath": str(c.static_pods),
            "fileCheckFrequency": "2s",
            **self._kubelet_choice().config,
        }
        c.static_pods.mkdir(exist_ok=True)
        (c.state / "kubelet.yaml").write_text(yaml.safe_dump(config))
        c.processes.spawn("kubelet", self._kubelet_argv())
        wait_for(lambda: self.get() is not None, timeout=60, what=f"node {NODE} to register")

    def _kubelet_argv(self) -> list[Any]:
        c = self.cluster
        return [
            c.bin / "kubelet",
            "--config", c.state / "kubelet.yaml",
            "--kubeconfig", c.kubeconfig_for("admin"),
            *self._kubelet_choice().flags,
            "--hostname-override", NODE,
            "--node-ip", NODE_IP,
            "--root-dir", KUBELET_ROOT,
            "--node-labels", "gpushare=true",
        ]  # fmt: skip

    def _kubelet_choice(self) -> versions.KubeletChoice:
        return versions.kubelet(
            self.cluster.version("kubelet"),
            runtime_endpoint=f"unix://{self.cluster.containerd_socket}",
            pause_image=PAUSE_IMAGE,
            cgroup_v1=not Path("/sys/fs/cgroup/cgroup.controllers").exists(),
        )

    def restart_kubelet(self) -> None:
        self.cluster.processes.stop("kubelet")
        self.cluster.processes.spawn("kubelet", self._kubelet_argv())

    def get(self) -> dict[str, Any] | None:
        """The Node object, as the API server has it; None before the kubelet registered it."""
        result = self.cluster.kubectl("get", "node", NODE, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def wait_ready(self, *, timeout: float = 90) -> dict[str, Any]:
        """Until the node is Ready, untainted, and kubelet offers gpu-mem from our device plugin."""

        def ready() -> dict[str, Any] | None:
            node = self.get()
            if node is None:
                return None
            conditions = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
            allocatable = node["status"].get("allocatable", {})
            usable = (
                conditions.get("Ready") == "True"
                and not node["spec"].get("taints")
                and int(allocatable.get("aliyun.com/gpu-mem", "0")) > 0
            )
            return node if usable else None

        return wait_for(ready, timeout=timeout, what=f"node {NODE} Ready with aliyun.com/gpu-mem", interval=0.5)  # type: ignore[no-any-return]

    # --- the gpushared daemon --------------------------------------------------------------------------------

    def start_daemon(self, *, memory_unit: str = "GiB", dra: bool = False, **options: Any) -> None:
        """The daemon as the .deb runs it; ``dra``: in DRA mode (docs/dra.md), the device plugin off;
        ``options``: config keys in place of the harness's (``deviceListStrategy=["cdi-annotations"]``)."""
        c = self.cluster
        gpus = c.gpus
        gpus.make_device_nodes(gpus.gpu_count())
        config = {
            "nodeName": NODE,
            # a DRA node writes its own slice: it runs as its own identity (deploy/dra/admission-policy.yaml)
            "kubeconfig": str(c.kubeconfig_for("gpushared-node-own" if dra else "gpushared-node")),
            "kubeletDir": str(KUBELET_ROOT),
            "memoryUnit": memory_unit,
            # Both ways at once: the UUIDs for NVIDIA's hook (absent here) and the device files, which
            # containerd's own device handling gives the container (e2e: each sees its GPUs' files only).
            "deviceListStrategy": ["envvar"],
            "deviceNodes": True,
            "devRoot": str(gpus.dev_root),
            # the port names no one; the tests read what root on the node reads, from the local socket
            "metrics": {
                "address": "127.0.0.1",
                "port": c.ports.daemon_metrics,
                "healthPort": c.ports.daemon_health,
                "socket": str(self.status_socket),
            },
            # The real nvidia-cuda-mps-control: its control daemons run without a GPU (servers cannot).
            "mps": {
                "enabled": True,
                "root": str(c.mps_root),
                "controlBinary": str(fetch_mps_control(c.mps_cache)),
                "probeSeconds": 1,
            },
        }
        if dra:
            config["mode"] = "dra"
            config["dra"] = {"cdiRoot": str(c.cdi_root)}
        config.update(options)
        (c.state / "gpushared.yaml").write_text(yaml.safe_dump(config))
        c.processes.spawn(
            "gpushared",
            [sys.executable, "-m", "gpushared.cli.daemon", "serve", "--config", c.state / "gpushared.yaml"],
            env={"LD_LIBRARY_PATH": str(gpus.file.parent), "FAKE_NVML_CONFIG": str(gpus.file)},
        )

    def restart_daemon(self, *, memory_unit: str = "GiB", dra: bool = False, **options: Any) -> None:
        self.cluster.processes.stop("gpushared")
        self.start_daemon(memory_unit=memory_unit, dra=dra, **options)

    def wait_serving(self, *, timeout: float = 60) -> None:
        """Until a (re)started daemon serves the kubelet: the kubelet reads its devices (device-plugin mode),
        or has its plugin and the slice is out (DRA mode). The node's allocatable lags behind: after a
        restart it still shows the old plugin's devices while the kubelet admits against none."""
        wait_for(
            lambda: self.daemon_status().get("kubeletWatching"), timeout=timeout, what="gpushared serving the kubelet"
        )

    @property
    def status_socket(self) -> Path:
        return self.cluster.state / "gpushared-status.sock"

    def daemon_metrics(self) -> str:
        """The daemon's /metrics with the per-pod series, as root on the node reads it (the local socket)."""
        return get_local(self.status_socket, "/metrics", timeout=2).decode()

    def daemon_status(self) -> dict[str, Any]:
        """``gpushared status --json``'s source: the daemon's /status; empty while it does not answer."""
        try:
            return json.loads(get_local(self.status_socket, "/status", timeout=2))  # type: ignore[no-any-return]
        except OSError:
            return {}

    def daemon_registrations(self) -> int:
        """How often gpushared has registered with the kubelet (its Prometheus counter)."""
        try:
            text = self.daemon_metrics()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("gpushared_kubelet_registrations_total "):
                return int(float(line.split()[1]))
        return 0
