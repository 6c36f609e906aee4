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
import io
import json
import os
import secrets
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from tests.builders import scheduler_config
from tests.e2e import versions
from tests.e2e.versions import Version
from tests.fakes.nvml import FakeNvml, build_library
from tests.harness import free_port
from tests.mps_binary import fetch_mps_control

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
}

PAUSE_SOURCE = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGINT, stop);
    signal(SIGTERM, stop);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


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

    @classmethod
    def pick(cls) -> Ports:
        chosen: set[int] = set()
        values = []
        for _ in range(10):
            port = free_port()
            while port in chosen:
                port = free_port()
            chosen.add(port)
            values.append(port)
        return cls(*values)


def wait_for(condition: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class LocalCluster:
    def __init__(self, *, state: Path = STATE, cache: Path = CACHE) -> None:
        self.state = state
        self.bin = cache / "bin"
        self.mps_cache = cache / "mps"
        self.cni_bin = cache / "cni"
        self.logs = state / "logs"
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._ports: Ports | None = None
        self._tokens: dict[str, str] | None = None
        self._versions: dict[str, Version] = {}
        #: where the extender's and kube-scheduler's certificates are (ca.crt, extender.*, scheduler.*): the
        #: cluster's own CA, or a directory scripts/extender-certs wrote, as an operator's guide has it
        self.extender_certs = state / "pki"
        #: the extender on plain HTTP (``restart_extender(plain=True)``; benchmarks only)
        self.extender_plain = False

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
    def gpus_file(self) -> Path:
        """The fake NVML library's GPUs (JSON, re-read by the library on change)."""
        return self.state / "nvml" / "gpus.json"

    @property
    def static_pods(self) -> Path:
        """The kubelet's static pod directory (``staticPodPath``; kubeadm's /etc/kubernetes/manifests)."""
        return self.state / "manifests"

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
            self._start_containerd()
            self._node_address()
            self._start_kubelet()
            self._start_extender()
            self._start_scheduler()
            self.write_gpus(GPU_SIZES_MIB)
            self.start_daemon()
            self.wait_node_ready()
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
        self._pki()
        self._start_etcd()
        self._start_apiserver()
        self._bootstrap()

    def _pki(self) -> None:
        pki = self.state / "pki"
        pki.mkdir()

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                "-days", "30", "-subj", "/CN=gpushared-local-ca")  # fmt: skip
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
                "-subj", "/CN=kube-apiserver")  # fmt: skip
        (pki / "san.ext").write_text(
            "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\n"
        )
        openssl(
            "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "apiserver.crt", "-days", "30", "-extfile", "san.ext",
        )  # fmt: skip
        # The extender's mutual TLS, as scripts/extender-certs sets it up: its serving certificate (also its
        # client certificate when a follower forwards to the leader) and kube-scheduler's client certificate,
        # on P-256 keys (signed here by the cluster's RSA CA).
        for name, usage in (("extender", "serverAuth,clientAuth"), ("scheduler", "clientAuth")):
            common = "gpushared-extender" if name == "extender" else "system:kube-scheduler"
            openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={common}")  # fmt: skip
            (pki / f"{name}.ext").write_text(f"extendedKeyUsage={usage}\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
            openssl(
                "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "30", "-extfile", f"{name}.ext",
            )  # fmt: skip
        openssl("genrsa", "-out", "sa.key", "2048")
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        lines = [f'{self.tokens[key]},{name},{key},"{group}"' for key, (name, group) in USERS.items()]
        (pki / "tokens.csv").write_text("\n".join(lines) + "\n")
        for user in USERS:
            self._write_kubeconfig(self.kubeconfig_for(user), user)
        self._write_kubeconfig(self.kubeconfig, "admin")

    def _write_kubeconfig(self, path: Path, user: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "gpushared",
                    "cluster": {"server": self.server, "certificate-authority": str(self.state / "pki" / "ca.crt")},
                }
            ],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "gpushared", "context": {"cluster": "gpushared", "user": user}}],
            "current-context": "gpushared",
        }
        path.write_text(yaml.safe_dump(body))
        path.chmod(0o600)

    def _start_etcd(self) -> None:
        p = self.ports
        self._spawn(
            "etcd",
            [
                self.bin / "etcd",
                "--name", "gpushared",
                "--data-dir", self.state / "etcd",
                "--listen-client-urls", f"http://127.0.0.1:{p.etcd}",
                "--advertise-client-urls", f"http://127.0.0.1:{p.etcd}",
                "--listen-peer-urls", f"http://127.0.0.1:{p.etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{p.etcd_peer}",
                "--initial-cluster", f"gpushared=http://127.0.0.1:{p.etcd_peer}",
            ],
        )  # fmt: skip

    def _start_apiserver(self) -> None:
        pki = self.state / "pki"
        self._spawn(
            "kube-apiserver",
            [
                self.bin / "kube-apiserver",
                "--etcd-servers", f"http://127.0.0.1:{self.ports.etcd}",
                "--bind-address", "127.0.0.1",
                "--advertise-address", "127.0.0.1",
                "--secure-port", self.ports.apiserver,
                *versions.apiserver_flags(self.version("kube-apiserver")),
                "--tls-cert-file", pki / "apiserver.crt",
                "--tls-private-key-file", pki / "apiserver.key",
                "--client-ca-file", pki / "ca.crt",
                "--token-auth-file", pki / "tokens.csv",
                "--authorization-mode", "RBAC",
                "--service-account-key-file", pki / "sa.pub",
                "--service-account-signing-key-file", pki / "sa.key",
                "--service-account-issuer", "https://kubernetes.default.svc",
                "--service-cluster-ip-range", "10.96.0.0/16",
                # The kubernetes Service's endpoints cannot be a loopback address; nothing here needs them.
                "--endpoint-reconciler-type", "none",
                "--kubelet-preferred-address-types", "InternalIP",
                "--allow-privileged",
                "--profiling=false",
            ],
        )  # fmt: skip
        wait_for(lambda: self._get("/readyz") == 200, timeout=60, what="kube-apiserver /readyz")

    def _get(self, path: str) -> int:
        import ssl

        context = ssl.create_default_context(cafile=str(self.state / "pki" / "ca.crt"))
        request = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {self.tokens['admin']}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as response:
                return int(response.status)
        except OSError:
            return 0

    def _bootstrap(self) -> None:
        """The identities and RBAC of deploy/, as an administrator applies them."""
        self.kubectl("apply", "-f", ROOT / "deploy" / "node-rbac.yaml")
        rbac = [
            doc
            for doc in yaml.safe_load_all((ROOT / "deploy" / "extender.yaml").read_text())
            if doc and doc["kind"] not in ("Deployment", "Service")  # the extender runs as a process here
        ]
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))

    def _start_controller_manager(self) -> None:
        pki = self.state / "pki"
        self._spawn(
            "kube-controller-manager",
            [
                self.bin / "kube-controller-manager",
                "--kubeconfig", self.kubeconfig_for("admin"),
                "--bind-address", "127.0.0.1",
                "--secure-port", self.ports.controller_manager,
                *versions.insecure_port_flags(self.version("kube-controller-manager")),
                "--leader-elect=false",
                "--service-account-private-key-file", pki / "sa.key",
                "--root-ca-file", pki / "ca.crt",
                "--use-service-account-credentials=false",
                "--authentication-skip-lookup",
                "--node-monitor-grace-period", "20s",
            ],
        )  # fmt: skip

    def _start_containerd(self) -> None:
        base = self.state / "containerd"
        net = self.state / "cni"
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
  address = "{self.containerd_socket}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # The sandbox lacks CAP_SYS_RESOURCE: without this runc cannot lower a container's oom_score_adj.
  restrict_oom_score_adj = true
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{self.bin}/runc"
  Root = "{base}/runc"
[{cri}.cni]
  bin_dir = "{self.cni_bin}"
  conf_dir = "{net}/net.d"
"""
        )
        self._spawn("containerd", [self.bin / "containerd", "--config", base / "config.toml"])
        wait_for(lambda: self._ctr("version", check=False).returncode == 0, timeout=30, what="containerd")
        images = self.state / "images"
        images.mkdir()
        self._ctr("images", "import", build_pause_image(images))
        self._ctr("images", "import", build_busybox_image(images, self.bin / "busybox"))

    def _ctr(self, *args: Any, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        argv = [self.bin / "ctr", "--address", self.containerd_socket, "--namespace", "k8s.io", *args]
        return subprocess.run([str(a) for a in argv], capture_output=True, check=check)

    def _node_address(self) -> None:
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

    def _start_kubelet(self) -> None:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "port": self.ports.kubelet,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.ports.kubelet_healthz,
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
            "staticPodPath": str(self.static_pods),
            "fileCheckFrequency": "2s",
            **self._kubelet_choice().config,
        }
        self.static_pods.mkdir(exist_ok=True)
        (self.state / "kubelet.yaml").write_text(yaml.safe_dump(config))
        self._spawn("kubelet", self._kubelet_argv())
        wait_for(lambda: self._node() is not None, timeout=60, what=f"node {NODE} to register")

    def _kubelet_argv(self) -> list[Any]:
        return [
            self.bin / "kubelet",
            "--config", self.state / "kubelet.yaml",
            "--kubeconfig", self.kubeconfig_for("admin"),
            *self._kubelet_choice().flags,
            "--hostname-override", NODE,
            "--node-ip", NODE_IP,
            "--root-dir", KUBELET_ROOT,
            "--node-labels", "gpushare=true",
        ]  # fmt: skip

    def _kubelet_choice(self) -> versions.KubeletChoice:
        return versions.kubelet(
            self.version("kubelet"),
            runtime_endpoint=f"unix://{self.containerd_socket}",
            pause_image=PAUSE_IMAGE,
            cgroup_v1=not Path("/sys/fs/cgroup/cgroup.controllers").exists(),
        )

    def restart_kubelet(self) -> None:
        self.stop("kubelet")
        self._spawn("kubelet", self._kubelet_argv())

    def _node(self) -> dict[str, Any] | None:
        result = self.kubectl("get", "node", NODE, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def import_image(self, archive: Path) -> None:
        """An image archive (``docker save`` format, as ``make image`` exports) into the kubelet's containerd."""
        self._ctr("images", "import", archive)

    def _start_extender(self, *extra: str) -> None:
        pki = self.extender_certs
        tls = [] if self.extender_plain else [
            "--tls-cert", pki / "extender.crt",
            "--tls-key", pki / "extender.key",
            "--client-ca", pki / "ca.crt",
            "--client-name", "system:kube-scheduler",
            "--client-name", "gpushared-extender",
        ]  # fmt: skip
        self._spawn(
            "gpushared-extender",
            [
                sys.executable, "-m", "gpushared.cli.extender",
                "--address", "127.0.0.1",
                "--port", self.ports.extender,
                "--kubeconfig", self.kubeconfig_for("gpushared-extender"),
                "--leader-elect",
                "--lease-seconds", "4",
                *tls,
                *extra,
            ],
        )  # fmt: skip
        wait_for(self.extender_ready, timeout=30, what="gpushared-extender /readyz")

    @property
    def extender_url(self) -> str:
        scheme = "http" if self.extender_plain else "https"
        return f"{scheme}://127.0.0.1:{self.ports.extender}"

    def extender_tls(self, *, client: bool = False) -> ssl.SSLContext:
        """Trusting the extender's certificate; with ``client``, presenting one it takes (its own)."""
        pki = self.extender_certs
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        if client:
            context.load_cert_chain(str(pki / "extender.crt"), str(pki / "extender.key"))
        return context

    def extender_ready(self) -> bool:
        try:
            url = f"{self.extender_url}/readyz"
            with urllib.request.urlopen(url, timeout=2, context=self.extender_tls()) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def restart_extender(self, *args: str, kill: bool = False, certs: Path | None = None, plain: bool = False) -> None:
        """Stop the extender process and start it again, with the certificates in ``certs`` if given, and
        ``args`` added to its command line (``--policy balanced``) until it restarts again. ``plain``: on
        plain HTTP, no TLS, and kube-scheduler wired to it so from its next start; only for
        scripts/bench_scheduler.py to measure what TLS costs (anyone on the host could bind pods)."""
        self.stop("gpushared-extender", sig=signal.SIGKILL if kill else signal.SIGTERM)
        self.extender_certs = certs or self.extender_certs
        self.extender_plain = plain
        self._start_extender(*args)

    def restart_scheduler(
        self,
        *,
        extenders: bool = True,
        adjust: Callable[[dict[str, Any]], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """kube-scheduler again; without ``extenders``, as a managed cluster's: stock, knowing no extender.
        ``adjust`` may change the KubeSchedulerConfiguration document before it is written (a benchmark's
        variant: no prioritize, another ``percentageOfNodesToScore``); ``env`` is added to its environment
        (``DISABLE_HTTP2``)."""
        self.stop("kube-scheduler")
        self._start_scheduler(extenders=extenders, adjust=adjust, env=env)

    def scheduler_metrics(self) -> str:
        """kube-scheduler's /metrics page: from the plain-HTTP metrics address while its configuration has one
        (v1beta1, 1.20), else from its secure port as the admin (its serving certificate is self-signed)."""
        if versions.scheduler_api(self.version("kube-scheduler")).bind_addresses:
            request = urllib.request.Request(f"http://127.0.0.1:{self.ports.scheduler_health}/metrics")
            context = None
        else:
            request = urllib.request.Request(
                f"https://127.0.0.1:{self.ports.scheduler}/metrics",
                headers={"Authorization": f"Bearer {self.tokens['admin']}"},
            )
            context = ssl.create_default_context()
            context.check_hostname = False  # loopback, and the scheduler's own self-signed certificate
            context.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return str(response.read().decode())

    def _start_scheduler(
        self,
        *,
        extenders: bool = True,
        adjust: Callable[[dict[str, Any]], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        p = self.ports
        version = self.version("kube-scheduler")
        chosen = versions.scheduler_api(version)
        config = chosen.document(
            extenders=self._extenders(chosen.shipped) if extenders else [],
            kubeconfig=str(self.kubeconfig_for("admin")),
            health=f"127.0.0.1:{p.scheduler_health}",
        )
        if adjust is not None:
            adjust(config)
        (self.state / "scheduler.yaml").write_text(yaml.safe_dump(config))
        self._spawn(
            "kube-scheduler",
            [
                self.bin / "kube-scheduler",
                "--config", self.state / "scheduler.yaml",
                "--bind-address", "127.0.0.1",
                "--secure-port", p.scheduler,
                *versions.insecure_port_flags(version),
            ],
            env=env,
        )  # fmt: skip

    def _extenders(self, shipped: Path) -> list[dict[str, Any]]:
        """The shipped file's extenders with this cluster's address and certificate paths, and the opt-in
        entry for pods without GPU uncommented (a test scores it)."""
        extenders = scheduler_config(shipped, no_gpu_scoring=True)["extenders"]
        pki = self.extender_certs
        for extender in extenders:
            extender["urlPrefix"] = f"{self.extender_url}/gpushare-scheduler"
            if self.extender_plain:
                extender["enableHTTPS"] = False
                extender.pop("tlsConfig", None)
                continue
            extender["tlsConfig"] = {
                "certFile": str(pki / "scheduler.crt"),
                "keyFile": str(pki / "scheduler.key"),
                "caFile": str(pki / "ca.crt"),
            }
        return list(extenders)

    # --- the gpushared daemon on simulated GPUs -----------------------------------------------------------

    def write_gpus(self, sizes_mib: Sequence[int]) -> FakeNvml:
        return FakeNvml.with_sizes(self.gpus_file, build_library(self.gpus_file.parent), *sizes_mib)

    def write_layout(self, layout: str, size_mib: int) -> FakeNvml:
        """GPUs of ``size_mib`` linked as a layout of ``tests.fakes.topologies`` ("dgx1"...)."""
        return FakeNvml.with_layout(self.gpus_file, build_library(self.gpus_file.parent), layout, size_mib)

    def gpu_count(self) -> int:
        """How many GPUs the fake NVML shows now."""
        return len(json.loads(self.gpus_file.read_text())["devices"])

    def set_gpu_processes(self, index: int, processes: Sequence[tuple[int, int]]) -> None:
        """What the fake NVML lists on GPU ``index``: (host PID, MiB); the daemon reads it on its next poll."""
        body = json.loads(self.gpus_file.read_text())
        body["devices"][index]["processes"] = [{"pid": pid, "usedMiB": mib} for pid, mib in processes]
        scratch = self.gpus_file.with_suffix(".tmp")
        scratch.write_text(json.dumps(body, indent=1))
        scratch.replace(self.gpus_file)

    def clear_gpu_processes(self) -> None:
        for index in range(self.gpu_count()):
            self.set_gpu_processes(index, [])

    @staticmethod
    def container_pids(container_id: str) -> list[int]:
        """The host PIDs of a container's processes, from their cgroups, lowest (its first process) first."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if container_id in (entry / "cgroup").read_text():
                        found.append(int(entry.name))
        return sorted(found)

    def daemon_metrics(self) -> str:
        url = f"http://127.0.0.1:{self.ports.daemon_metrics}/metrics"
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()  # type: ignore[no-any-return]

    def extender_metrics(self) -> str:
        """The extender's /metrics page, asked with a client certificate it takes."""
        url = f"{self.extender_url}/metrics"
        with urllib.request.urlopen(url, timeout=10, context=self.extender_tls(client=True)) as response:
            return str(response.read().decode())

    @property
    def mps_root(self) -> Path:
        return self.state / "mps"

    @property
    def dev_root(self) -> Path:
        return self.state / "dev-root"

    def make_device_nodes(self, count: int) -> None:
        """The fake GPUs' device files, for deviceNodes: harmless character devices (/dev/null's numbers)
        named as the driver names them, under the daemon's devRoot; the real /dev is left alone."""
        dev = self.dev_root / "dev"
        dev.mkdir(parents=True, exist_ok=True)
        for name in [f"nvidia{minor}" for minor in range(count)] + ["nvidiactl", "nvidia-uvm"]:
            if not (dev / name).exists():
                os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(1, 3))

    def start_daemon(self, *, memory_unit: str = "GiB") -> None:
        self.make_device_nodes(self.gpu_count())
        config = {
            "nodeName": NODE,
            "kubeconfig": str(self.kubeconfig_for("gpushared-node")),
            "kubeletDir": str(KUBELET_ROOT),
            "memoryUnit": memory_unit,
            # Both ways at once: the UUIDs for NVIDIA's hook (absent here) and the device files, which
            # containerd's own device handling gives the container (e2e: each sees its GPUs' files only).
            "deviceListStrategy": ["envvar"],
            "deviceNodes": True,
            "devRoot": str(self.dev_root),
            "metrics": {"address": "127.0.0.1", "port": self.ports.daemon_metrics},
            # The real nvidia-cuda-mps-control: its control daemons run without a GPU (servers cannot).
            "mps": {
                "enabled": True,
                "root": str(self.mps_root),
                "controlBinary": str(fetch_mps_control(self.mps_cache)),
                "probeSeconds": 1,
            },
        }
        (self.state / "gpushared.yaml").write_text(yaml.safe_dump(config))
        self._spawn(
            "gpushared",
            [sys.executable, "-m", "gpushared.cli.daemon", "serve", "--config", self.state / "gpushared.yaml"],
            env={"LD_LIBRARY_PATH": str(self.gpus_file.parent), "FAKE_NVML_CONFIG": str(self.gpus_file)},
        )

    def daemon_status(self) -> dict[str, Any]:
        """``gpushared status --json``'s source: the daemon's /status; empty while it does not answer."""
        try:
            url = f"http://127.0.0.1:{self.ports.daemon_metrics}/status"
            with urllib.request.urlopen(url, timeout=2) as response:
                return json.load(response)  # type: ignore[no-any-return]
        except OSError:
            return {}

    def daemon_registrations(self) -> int:
        """How often gpushared has registered with the kubelet (its Prometheus counter)."""
        try:
            url = f"http://127.0.0.1:{self.ports.daemon_metrics}/metrics"
            with urllib.request.urlopen(url, timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("gpushared_kubelet_registrations_total "):
                return int(float(line.split()[1]))
        return 0

    def extender_inspect(self, node: str = NODE) -> dict[str, Any]:
        """The extender's own view of a node (its cache), not the API's."""
        url = f"{self.extender_url}/gpushare-scheduler/inspect/{node}"
        with urllib.request.urlopen(url, timeout=5, context=self.extender_tls(client=True)) as response:
            [report] = json.load(response)["nodes"]
            return report  # type: ignore[no-any-return]

    def inspect_json(self) -> dict[str, Any]:
        """``kubectl inspect gpushare -o json``, as an administrator runs it."""
        plugin = Path(sys.executable).parent / "kubectl-inspect-gpushare"
        result = subprocess.run(
            [str(plugin), "--kubeconfig", str(self.kubeconfig), "-o", "json"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return json.loads(result.stdout)  # type: ignore[no-any-return]

    def restart_daemon(self, *, memory_unit: str = "GiB") -> None:
        self.stop("gpushared")
        self.start_daemon(memory_unit=memory_unit)

    def wait_node_ready(self, *, timeout: float = 90) -> dict[str, Any]:
        """Until the node is Ready, untainted, and kubelet offers gpu-mem from our device plugin."""

        def ready() -> dict[str, Any] | None:
            node = self._node()
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

    # --- processes ----------------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: Sequence[Any], *, env: dict[str, str] | None = None) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        process = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "PATH": f"{self.bin}:{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
            },
            cwd=self.state,
            start_new_session=True,  # Ctrl-C in the shell that ran `make demo` must not reach the cluster
        )
        log.close()
        self._children[name] = process
        record = {"pid": process.pid, "created": psutil.Process(process.pid).create_time()}
        pids = self.state / "pids"
        pids.mkdir(exist_ok=True)
        (pids / name).write_text(json.dumps(record))
        time.sleep(0.2)
        if process.poll() is not None:
            raise ClusterError(f"{name} exited at once ({process.returncode}): see {self.logs / (name + '.log')}")

    def _recorded(self) -> Iterator[tuple[str, psutil.Process]]:
        """The processes we started that still run: same pid *and* start time, so a reused pid is never hit."""
        pids = self.state / "pids"
        if not pids.is_dir():
            return
        for path in sorted(pids.iterdir()):
            record = json.loads(path.read_text())
            try:
                process = psutil.Process(record["pid"])
                if abs(process.create_time() - record["created"]) < 0.01 and process.status() != "zombie":
                    yield path.name, process
            except psutil.NoSuchProcess:
                continue

    def running(self) -> list[str]:
        return [name for name, _ in self._recorded()]

    def process(self, name: str) -> psutil.Process | None:
        """The running process this cluster started under ``name`` (kube-scheduler, etcd...), if any."""
        return next((process for recorded, process in self._recorded() if recorded == name), None)

    def leftovers(self) -> list[str]:
        """Anything still running that this cluster started: a process naming its state directory, or a
        process in a pod's cgroup."""
        found = [
            f"{p.pid} {' '.join(p.info['cmdline'])[:120]}"
            for p in psutil.process_iter(["cmdline"])
            if p.pid != os.getpid() and any(str(self.state) in arg for arg in p.info["cmdline"] or [])
        ]
        found += [f"{pid} in {cgroup}" for cgroup in _kubepods_cgroups() for pid in _cgroup_pids(cgroup)]
        found += [f"{p.pid} MPS control daemon" for p in self._mps_daemons()]
        return found

    def stop(self, name: str, *, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> None:
        for recorded, process in self._recorded():
            if recorded == name:
                process.send_signal(sig)
                try:
                    process.wait(timeout)
                except psutil.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        child = self._children.pop(name, None)
        if child is not None:
            child.wait(10)
        (self.state / "pids" / name).unlink(missing_ok=True)

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
            self._remove_containers()
        for name in (
            "kube-scheduler", "gpushared-extender", "gpushared", "kubelet", "containerd",
            "kube-controller-manager", "kube-apiserver", "etcd",
        ):  # fmt: skip
            self.stop(name)
        self._stop_mps()
        self._kill_shims()
        self._kill_pod_processes()
        self._unmount()
        self._remove_cgroups()
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
        self._children.clear()

    def _stop_mps(self) -> None:
        """The MPS control daemons outlive gpushared on purpose; `gpushared mps stop` is how they end."""
        config = self.state / "gpushared.yaml"
        if config.exists():
            stop = [sys.executable, "-m", "gpushared.cli.daemon", "mps", "stop", "--config", str(config)]
            subprocess.run(stop, capture_output=True, check=False, timeout=60)
        for process in self._mps_daemons():
            process.kill()

    def _mps_daemons(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.Error):
                pipe = process.environ().get("CUDA_MPS_PIPE_DIRECTORY", "") if "mps" in process.info["name"] else ""
                if pipe.startswith(str(self.mps_root)):
                    found.append(process)
        return found

    def _remove_containers(self) -> None:
        tasks = self._ctr("tasks", "list", "--quiet", check=False).stdout.decode().split()
        for task in tasks:
            self._ctr("tasks", "kill", "--all", "--signal", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 10
        for task in tasks:
            while self._ctr("tasks", "delete", task, check=False).returncode != 0 and time.monotonic() < deadline:
                time.sleep(0.2)
        for container in self._ctr("containers", "list", "--quiet", check=False).stdout.decode().split():
            self._ctr("containers", "delete", container, check=False)

    def _kill_shims(self) -> None:
        """containerd's shims re-parent themselves away from containerd; they name our socket on their command line."""
        marker = str(self.containerd_socket)
        for process in psutil.process_iter(["cmdline"]):
            if marker in (process.info["cmdline"] or []) and "containerd-shim" in " ".join(process.info["cmdline"]):
                process.kill()

    def _kill_pod_processes(self) -> None:
        for cgroup in _kubepods_cgroups():
            for pid in _cgroup_pids(cgroup):
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(pid).kill()

    def _unmount(self) -> None:
        roots = (str(KUBELET_ROOT), str(self.state), "/run/containerd")
        mounts = [
            line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines() if len(line.split()) > 4
        ]
        ours = [m for m in mounts if any(m == r or m.startswith(r + "/") for r in roots)]
        for mount in sorted(ours, key=lambda m: m.count("/"), reverse=True):
            if subprocess.run(["umount", mount], capture_output=True, check=False).returncode != 0:
                subprocess.run(["umount", "-l", mount], capture_output=True, check=False)

    def _remove_cgroups(self) -> None:
        for _ in range(20):
            remaining = _kubepods_cgroups()
            if not remaining:
                return
            for cgroup in sorted(remaining, key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
            time.sleep(0.1)
        raise ClusterError(f"cgroups left behind: {', '.join(map(str, _kubepods_cgroups()))}")


def _kubepods_cgroups() -> list[Path]:
    found: list[Path] = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        for top in (hierarchy / "kubepods", hierarchy / "kubepods.slice"):
            if top.is_dir():
                found.extend(p for p in [top, *top.rglob("*")] if p.is_dir())
    return found


def _cgroup_pids(cgroup: Path) -> list[int]:
    try:
        return [int(line) for line in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


# --- images without a registry ----------------------------------------------------------------------------


def _docker_archive(path: Path, tag: str, files: dict[str, tuple[bytes | str, int]], cmd: list[str]) -> Path:
    """A one-layer image in ``docker save`` format, which ``ctr images import`` reads.

    ``files`` maps a path in the image to its content (bytes) or a symlink target (str), with its mode.
    """
    import hashlib

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        dirs = sorted({str(Path(name).parent) for name in files} - {"."} | {"tmp", "etc", "proc", "sys", "dev"})
        for directory in dirs:
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        for name, (content, mode) in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.mode = mode
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": cmd, "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(path, "w") as archive:
        for name, data in (("layer.tar", layer_bytes), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def build_pause_image(out: Path) -> Path:
    source = out / "pause.c"
    source.write_text(PAUSE_SOURCE)
    subprocess.run(["gcc", "-static", "-O2", "-o", out / "pause", source], check=True, capture_output=True)
    binary = (out / "pause").read_bytes()
    return _docker_archive(out / "pause.tar", PAUSE_IMAGE, {"pause": (binary, 0o755)}, ["/pause"])


def build_busybox_image(out: Path, busybox: Path) -> Path:
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    files: dict[str, tuple[bytes | str, int]] = {"bin/busybox": (busybox.read_bytes(), 0o755)}
    files.update({f"bin/{applet}": ("busybox", 0o777) for applet in applets if applet != "busybox"})
    return _docker_archive(out / "busybox.tar", BUSYBOX_IMAGE, files, ["sh"])


def build_binary_image(out: Path, binary: Path, tag: str) -> Path:
    """An image of one static binary at /bin, its entry point: upstream's kube-scheduler image, made here
    from the cached build without a registry."""
    files: dict[str, tuple[bytes | str, int]] = {f"bin/{binary.name}": (binary.read_bytes(), 0o755)}
    return _docker_archive(out / f"{binary.name}.tar", tag, files, [f"/bin/{binary.name}"])


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
