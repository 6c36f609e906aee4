"""The control plane's command lines (etcd, kube-apiserver, kube-controller-manager), as functions of where
the cluster lives, its ports and each binary's version; ``LocalCluster`` starts them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e import versions
from tests.e2e.layout import Ports
from tests.e2e.versions import Version


def etcd_command(bin_dir: Path, state: Path, ports: Ports) -> list[Any]:
    return [
        bin_dir / "etcd",
        "--name", "gpushared",
        "--data-dir", state / "etcd",
        "--listen-client-urls", f"http://127.0.0.1:{ports.etcd}",
        "--advertise-client-urls", f"http://127.0.0.1:{ports.etcd}",
        "--listen-peer-urls", f"http://127.0.0.1:{ports.etcd_peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{ports.etcd_peer}",
        "--initial-cluster", f"gpushared=http://127.0.0.1:{ports.etcd_peer}",
    ]  # fmt: skip


def apiserver_command(bin_dir: Path, pki: Path, ports: Ports, version: Version) -> list[Any]:
    return [
        bin_dir / "kube-apiserver",
        "--etcd-servers", f"http://127.0.0.1:{ports.etcd}",
        "--bind-address", "127.0.0.1",
        "--advertise-address", "127.0.0.1",
        "--secure-port", ports.apiserver,
        *versions.apiserver_flags(version),
        *versions.feature_gate_flags(version),
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
    ]  # fmt: skip


def controller_manager_command(bin_dir: Path, pki: Path, ports: Ports, version: Version, kubeconfig: Path) -> list[Any]:
    return [
        bin_dir / "kube-controller-manager",
        "--kubeconfig", kubeconfig,
        "--bind-address", "127.0.0.1",
        "--secure-port", ports.controller_manager,
        *versions.insecure_port_flags(version),
        *versions.feature_gate_flags(version),
        "--leader-elect=false",
        "--service-account-private-key-file", pki / "sa.key",
        "--root-ca-file", pki / "ca.crt",
        "--use-service-account-credentials=false",
        "--authentication-skip-lookup",
        "--node-monitor-grace-period", "20s",
    ]  # fmt: skip
