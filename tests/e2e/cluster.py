"""A real Kubernetes 1.20 cluster on one machine, loopback only, with gpushared on simulated GPUs.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler (wired to our extender), containerd with a
bridge CNI network, kubelet, the gpushared daemon on the fake ``libnvidia-ml.so.1`` and the extender: every
part a user runs, except the GPU. The binaries come from ``scripts/k8s-testbins``; everything the cluster
writes lives in one state directory, except what kubelet 1.20 insists on (``/var/lib/kubelet``, whose
``device-plugins/`` path is compiled in, ``/var/log/pods``, the ``kubepods`` cgroups and the CNI bridge).

The cluster outlives the process that started it (``make demo`` returns to the shell), so every process is
recorded in the state directory with its start time, and :meth:`LocalCluster.down` stops exactly those, the
containers they ran, and then removes the mounts, cgroups and network it made. Needs root.

    python -m tests.e2e.cluster up | down | status
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import yaml

from tests.e2e import host
from tests.e2e.controlplane import apiserver_command, controller_manager_command, etcd_command
from tests.e2e.gpus import SimulatedGpus
from tests.e2e.images import build_binary_image, build_busybox_image, build_pause_image
from tests.e2e.layout import (
    BRIDGE,
    BUSYBOX_IMAGE,
    CACHE,
    GPU_SIZES_MIB,
    KUBELET_LEFTOVERS,
    KUBELET_ROOT,
    NODE,
    NODE_IP,
    NODE_LINK,
    PAUSE_IMAGE,
    ROOT,
    STATE,
    USERS,
    ClusterError,
    Ports,
    wait_for,
)
from tests.e2e.node import Node
from tests.e2e.pki import make_pki, write_kubeconfig
from tests.e2e.processes import Processes
from tests.e2e.scheduling import Scheduling
from tests.e2e.versions import Version

# What tests and scripts import from here, wherever it is defined.
__all__ = [
    "BUSYBOX_IMAGE",
    "CACHE",
    "GPU_SIZES_MIB",
    "NODE",
    "NODE_IP",
    "PAUSE_IMAGE",
    "ROOT",
    "ClusterError",
    "LocalCluster",
    "build_binary_image",
    "build_busybox_image",
    "build_pause_image",
    "wait_for",
]


def cached_version(binary: str) -> Version | None:
    """The version of one of the harness's cached binaries, without starting anything; None where there is
    none yet. What gated cases decide on at collection (tests/e2e/test_dra.py, test_cdi.py)."""
    try:
        return LocalCluster().version(binary)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


class LocalCluster:
    """The cluster as a whole: where it lives, bringing it up and down, the control plane (etcd,
    kube-apiserver, kube-controller-manager), and kubectl. Its parts: ``processes`` (what it started),
    ``node`` (containerd, kubelet, the gpushared daemon), ``gpus`` (the simulated GPUs), ``scheduling``
    (the extender and kube-scheduler)."""

    def __init__(self, *, state: Path = STATE, cache: Path = CACHE) -> None:
        self.state = state
        self.bin = cache / "bin"
        self.mps_cache = cache / "mps"
        self.cni_bin = cache / "cni"
        self.logs = state / "logs"
        self._ports: Ports | None = None
        self._tokens: dict[str, str] | None = None
        self._versions: dict[str, Version] = {}
        self.processes = Processes(state=state, logs=self.logs, bin=self.bin)
        self.gpus = SimulatedGpus(state)
        self.node = Node(self)
        self.scheduling = Scheduling(self)

    # --- layout -------------------------------------------------------------------------------------------

    @property
    def ports(self) -> Ports:
        if self._ports is None:
            self._ports = Ports(**json.loads((self.state / "ports.json").read_text()))
        return self._ports

    @property
    def tokens(self) -> dict[str, str]:
        if self._tokens is None:
            self._tokens = json.loads((self.state / "tokens.json").read_text())
        return self._tokens

    def version(self, binary: str = "kube-apiserver") -> Version:
        """What a cached binary says it is: flags and configs are chosen by it (tests/e2e/versions.py)."""
        if binary not in self._versions:
            out = subprocess.run([str(self.bin / binary), "--version"], capture_output=True, text=True, check=True)
            self._versions[binary] = Version.parse(out.stdout + out.stderr)
        return self._versions[binary]

    @property
    def cdi_root(self) -> Path:
        """Where containerd (>= 1.7) reads CDI specs and gpushared in DRA mode writes them."""
        return self.state / "cdi"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig, for kubectl and the tests."""
        return self.state / "kubeconfig"

    @property
    def containerd_socket(self) -> Path:
        return self.state / "containerd" / "containerd.sock"

    @property
    def static_pods(self) -> Path:
        """The kubelet's static pod directory (``staticPodPath``; kubeadm's /etc/kubernetes/manifests)."""
        return self.state / "manifests"

    @property
    def mps_root(self) -> Path:
        return self.state / "mps"

    def kubeconfig_for(self, user: str) -> Path:
        return self.state / f"{user}.kubeconfig"

    def env(self) -> dict[str, str]:
        """What a shell needs to talk to the cluster with the cached kubectl and our kubectl plugin."""
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        }

    # --- bring up -----------------------------------------------------------------------------------------

    def up(self) -> None:
        """Start every part, in dependency order, and wait until a pod asking for gpu-mem can be scheduled."""
        if os.geteuid() != 0:
            raise ClusterError("the local cluster needs root (kubelet, containerd, mounts, cgroups)")
        missing = [t for t in ("kube-apiserver", "kubelet", "containerd", "etcd") if not (self.bin / t).exists()]
        if missing:
            raise ClusterError(f"{', '.join(missing)} missing in {self.bin}: run `make k8s-testbins` first")
        if self.running():
            raise ClusterError(f"a cluster is already running from {self.state}: `make demo-down` stops it")
        self.down()  # whatever a crashed run left behind
        foreign = [str(path) for path in KUBELET_LEFTOVERS if path.exists()]
        if foreign:
            raise ClusterError(
                f"{', '.join(foreign)} exist and are not this cluster's: is a kubelet installed here? "
                "The local cluster needs them for itself (kubelet 1.20 hard-codes its device-plugin path)."
            )
        shutil.rmtree(self.logs, ignore_errors=True)  # the previous run's, kept by down() until now
        self.logs.mkdir(parents=True)
        (self.state / "owns-kubelet-dirs").touch()
        if not Path("/run/containerd").exists():  # containerd's shims put their sockets there, whatever the config
            (self.state / "owns-run-containerd").touch()
        try:
            self._start_api()
            self._start_controller_manager()
            self.node.start_containerd()
            self.node.add_address()
            self.node.start_kubelet()
            self.scheduling.start_extender()
            self.scheduling.start_scheduler()
            self.gpus.write_gpus(GPU_SIZES_MIB)
            self.node.start_daemon()
            self.node.wait_ready()
        except BaseException:
            self.down()
            raise

    @contextlib.contextmanager
    def api_only(self) -> Iterator[LocalCluster]:
        """etcd and kube-apiserver with deploy/'s identities and RBAC, and nothing else: the real API server
        for benchmarks. No controllers, so nodes without a kubelet are never tainted nor their pods evicted;
        no kubelet, so stopping it touches nothing outside ``state`` (a cluster running beside it is safe)."""
        if self.running():
            raise ClusterError(f"a cluster is already running from {self.state}")
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self._start_api()
            yield self
        finally:
            self.stop("kube-apiserver")
            self.stop("etcd")
            shutil.rmtree(self.state, ignore_errors=True)

    def _start_api(self) -> None:
        self._ports = Ports.pick()
        (self.state / "ports.json").write_text(json.dumps(asdict(self._ports)))
        self._tokens = {user: secrets.token_hex(16) for user in USERS}
        (self.state / "tokens.json").write_text(json.dumps(self._tokens))
        make_pki(self.state / "pki", self._tokens)
        for user in USERS:
            self._write_kubeconfig(self.kubeconfig_for(user), user)
        self._write_kubeconfig(self.kubeconfig, "admin")
        self._start_etcd()
        self._start_apiserver()
        self.bootstrap_rbac()

    def _write_kubeconfig(self, path: Path, user: str) -> None:
        write_kubeconfig(path, server=self.server, ca=self.state / "pki" / "ca.crt", user=user, token=self.tokens[user])

    def _start_etcd(self) -> None:
        self.processes.spawn("etcd", etcd_command(self.bin, self.state, self.ports))

    def _start_apiserver(self) -> None:
        version = self.version("kube-apiserver")
        self.processes.spawn("kube-apiserver", apiserver_command(self.bin, self.state / "pki", self.ports, version))
        wait_for(lambda: self._get("/readyz") == 200, timeout=60, what="kube-apiserver /readyz")

    def _get(self, path: str) -> int:
        context = ssl.create_default_context(cafile=str(self.state / "pki" / "ca.crt"))
        request = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {self.tokens['admin']}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as response:
                return int(response.status)
        except OSError:
            return 0

    def bootstrap_rbac(self) -> None:
        """The identities and RBAC of deploy/, as an administrator applies them."""
        self.kubectl("apply", "-f", ROOT / "deploy" / "node-rbac.yaml")
        rbac = [
            doc
            for doc in yaml.safe_load_all((ROOT / "deploy" / "extender.yaml").read_text())
            # the extender runs as a process here: no Deployment, Service or PodDisruptionBudget
            if doc and doc["kind"] not in ("Deployment", "Service", "PodDisruptionBudget")
        ]
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))

    def _start_controller_manager(self) -> None:
        version, admin = self.version("kube-controller-manager"), self.kubeconfig_for("admin")
        command = controller_manager_command(self.bin, self.state / "pki", self.ports, version, admin)
        self.processes.spawn("kube-controller-manager", command)

    def inspect_json(self) -> dict[str, Any]:
        """``kubectl inspect gpushare -o json``, as an administrator runs it."""
        plugin = Path(sys.executable).parent / "kubectl-inspect-gpushare"
        result = subprocess.run(
            [str(plugin), "--kubeconfig", str(self.kubeconfig), "-o", "json"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return json.loads(result.stdout)  # type: ignore[no-any-return]

    # --- processes ----------------------------------------------------------------------------------------

    def running(self) -> list[str]:
        return self.processes.running()

    def process(self, name: str) -> psutil.Process | None:
        """The running process this cluster started under ``name`` (kube-scheduler, etcd...), if any."""
        return self.processes.process(name)

    def stop(self, name: str, *, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> None:
        self.processes.stop(name, sig=sig, timeout=timeout)

    def leftovers(self) -> list[str]:
        """Anything still running that this cluster started (``host.leftovers``)."""
        return host.leftovers(self.state, self.mps_root)

    def kubectl(self, *args: Any, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin / "kubectl"), "--kubeconfig", str(self.kubeconfig), *map(str, args)]
        result = subprocess.run(argv, input=input, capture_output=True, text=True, check=False, timeout=60)
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(map(str, args))}: {result.stderr.strip()}")
        return result

    # --- tear down ----------------------------------------------------------------------------------------

    def down(self) -> None:
        """Stop what we started, then undo what kubelet and containerd did to the machine. Idempotent."""
        if self.containerd_socket.exists() and "containerd" in self.running():
            self.stop("kubelet")
            self.node.remove_containers()
        for name in (
            "kube-scheduler", "gpushared-extender", "gpushared", "kubelet", "containerd",
            "kube-controller-manager", "kube-apiserver", "etcd",
        ):  # fmt: skip
            self.stop(name)
        self._stop_mps()
        host.kill_shims(self.containerd_socket)
        host.kill_pod_processes()
        host.unmount((str(KUBELET_ROOT), str(self.state), "/run/containerd"))
        host.remove_cgroups()
        if (self.state / "owns-kubelet-dirs").exists():  # never another kubelet's
            for link in (BRIDGE, NODE_LINK):
                subprocess.run(["ip", "link", "delete", link], capture_output=True, check=False)
            for path in KUBELET_LEFTOVERS:
                shutil.rmtree(path, ignore_errors=True)
        if (self.state / "owns-run-containerd").exists():
            shutil.rmtree("/run/containerd", ignore_errors=True)
        if self.state.exists():
            for entry in self.state.iterdir():
                if entry != self.logs:
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        self.processes.forget()

    def _stop_mps(self) -> None:
        """The MPS control daemons outlive gpushared on purpose; `gpushared mps stop` is how they end."""
        config = self.state / "gpushared.yaml"
        if config.exists():
            stop = [sys.executable, "-m", "gpushared.cli.daemon", "mps", "stop", "--config", str(config)]
            subprocess.run(stop, capture_output=True, check=False, timeout=60)
        for process in host.mps_daemons(self.mps_root):
            process.kill()


def main(argv: list[str]) -> int:
    cluster = LocalCluster()
    command = argv[0] if argv else "status"
    try:
        if command == "up":
            cluster.up()
            print(f"cluster up; state and logs in {cluster.state}")
        elif command == "down":
            cluster.down()
            print(f"cluster down; logs kept in {cluster.logs}")
        elif command == "status":
            running = cluster.running()
            print("running: " + (", ".join(running) if running else "nothing"))
        elif command == "env":
            for key, value in cluster.env().items():
                print(f"export {key}={value}")
        else:
            print("usage: python -m tests.e2e.cluster up|down|status|env", file=sys.stderr)
            return 2
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
