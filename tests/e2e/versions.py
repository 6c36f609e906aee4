"""What the local cluster passes to Kubernetes binaries of a given version: flags and configuration files.

The harness was written against 1.20.2 (what Debian ships); users run 1.30+. Flags and configuration APIs
were removed along the way, and a binary given one it no longer knows refuses to start, so every choice
that depends on the version is made here, from the version the binary itself reports (``--version``), by
pure functions the unit tests check for 1.20, 1.24, 1.29 and 1.36. Pointing ``GPUSHARED_K8S_CACHE`` at
newer binaries then needs nothing else. The product is not involved: only the harness differs.

What changed, and where (upstream changelogs):

- kube-apiserver ``--insecure-port``: only 0 allowed since 1.20, removed in 1.24.
- kube-controller-manager and kube-scheduler ``--port`` (insecure serving): no-ops from 1.23, removed after.
- kubelet ``--container-runtime``: removed in 1.27 (only ``remote`` remained after dockershim); the CRI
  endpoint moved into the configuration (``containerRuntimeEndpoint``, 1.27+).
- kubelet ``--pod-infra-container-image``: removed in 1.35 (the runtime's sandbox image decides).
- kubelet ``failCgroupV1``: from 1.35 the kubelet refuses cgroup v1 hosts unless it is false (field: 1.31+).
- PodDisruptionBudget: ``policy/v1`` from 1.21 (what deploy/ ships), ``policy/v1beta1`` before.
- ServiceAccount token Secrets: created by the controller manager before 1.24, not after.
- DRA (``resource.k8s.io/v1``): GA in 1.34, on by default; its consumable capacity (KEP-5075, what lets a
  claim take part of a GPU) is alpha in 1.34-1.35, behind ``DRAConsumableCapacity`` on the API server, the
  scheduler, the controller manager and the kubelet, and beta, on by default, from 1.36.
- containerd: CDI (what a prepared claim's devices are given to a container by) from 1.7, behind the CRI
  plugin's ``enable_cdi``; on by default in 2.0, whose configuration is version 3.
- kube-scheduler configuration: ``v1beta1`` (1.18-1.22, with ``healthzBindAddress``/``metricsBindAddress``),
  ``v1beta3`` (1.23-1.28, same extender fields, no bind addresses), ``v1`` (1.25+): from 1.25 the scheduler
  runs ``deploy/control-plane/scheduler-config.yaml`` as shipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER_V1 = ROOT / "deploy" / "control-plane" / "scheduler-config.yaml"
SCHEDULER_V1BETA1 = ROOT / "deploy" / "control-plane" / "scheduler-config-v1beta1.yaml"
SCHEDULER_GROUP = "kubescheduler.config.k8s.io"


@dataclass(frozen=True, order=True)
class Version:
    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> Version:
        """From what ``kubelet --version`` and friends print ("Kubernetes v1.36.0-alpha.1") or a bare tag."""
        match = re.search(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text)
        if match is None:
            raise ValueError(f"no Kubernetes version in {text!r}")
        return cls(int(match[1]), int(match[2]), int(match[3] or 0))

    def at_least(self, minor: int) -> bool:
        return (self.major, self.minor) >= (1, minor)

    def __str__(self) -> str:
        return f"v{self.major}.{self.minor}.{self.patch}"


@dataclass(frozen=True)
class SchedulerApi:
    """Which KubeSchedulerConfiguration API to write, and from which shipped file its extenders come."""

    api_version: str
    shipped: Path
    #: v1beta1 still carries the health and metrics addresses; later versions serve them on --secure-port.
    bind_addresses: bool

    def document(self, *, extenders: list[dict[str, Any]], kubeconfig: str, health: str) -> dict[str, Any]:
        """The shipped file as the scheduler runs it here: its API version for these binaries, our
        kubeconfig, no leader election (one scheduler), and the extenders given (the shipped ones with this
        cluster's address and certificate paths)."""
        body: dict[str, Any] = yaml.safe_load(self.shipped.read_text())
        body["apiVersion"] = self.api_version
        body["clientConnection"] = {"kubeconfig": kubeconfig}
        body["leaderElection"] = {"leaderElect": False}
        if self.bind_addresses:
            body["healthzBindAddress"] = body["metricsBindAddress"] = health
        if extenders:
            body["extenders"] = extenders
        else:  # a stock scheduler, as a managed cluster's
            body.pop("extenders", None)
        return body


def scheduler_api(version: Version) -> SchedulerApi:
    if version.at_least(25):
        return SchedulerApi(f"{SCHEDULER_GROUP}/v1", SCHEDULER_V1, bind_addresses=False)
    if version.at_least(23):
        # v1 is not served yet; v1beta3's extender fields are v1's, so the shipped v1 file is the source.
        return SchedulerApi(f"{SCHEDULER_GROUP}/v1beta3", SCHEDULER_V1, bind_addresses=False)
    return SchedulerApi(f"{SCHEDULER_GROUP}/v1beta1", SCHEDULER_V1BETA1, bind_addresses=True)


def apiserver_flags(version: Version) -> list[str]:
    return ["--insecure-port", "0"] if not version.at_least(24) else []


def scheduler_auth_flags(version: Version, *, kubeconfig: str) -> list[str]:
    """From 1.23 kube-scheduler serves /metrics and /debug/pprof only on its secure port, and without
    delegated authentication and authorization it answers every caller there 403. With them it asks the
    API server (TokenReview, SubjectAccessReview) about the bearer token; ``--authentication-skip-lookup``
    keeps it from reading the request-header CA from kube-system's extension-apiserver-authentication
    ConfigMap, which this cluster does not publish (without it, an error at every start and refresh)."""
    if scheduler_api(version).bind_addresses:
        return []
    return [
        "--authentication-kubeconfig", kubeconfig,
        "--authorization-kubeconfig", kubeconfig,
        "--authentication-skip-lookup",
    ]  # fmt: skip


def insecure_port_flags(version: Version) -> list[str]:
    """kube-controller-manager's and kube-scheduler's ``--port 0``, while the flag exists."""
    return ["--port", "0"] if not version.at_least(23) else []


@dataclass(frozen=True)
class KubeletChoice:
    flags: list[str]
    config: dict[str, Any] = field(default_factory=dict)


def kubelet(version: Version, *, runtime_endpoint: str, pause_image: str, cgroup_v1: bool) -> KubeletChoice:
    """The version-dependent part of the kubelet's command line and KubeletConfiguration."""
    flags: list[str] = []
    config: dict[str, Any] = {}
    if version.at_least(27):
        config["containerRuntimeEndpoint"] = runtime_endpoint
    else:
        flags += ["--container-runtime", "remote", "--container-runtime-endpoint", runtime_endpoint]
    if not version.at_least(35):
        flags += ["--pod-infra-container-image", pause_image]
    if cgroup_v1 and version.at_least(31):
        config["failCgroupV1"] = False
    if feature_gates(version):
        config["featureGates"] = feature_gates(version)
    return KubeletChoice(flags, config)


def pdb_api(version: Version) -> str:
    """The PodDisruptionBudget API this version serves (deploy/ ships policy/v1)."""
    return "policy/v1" if version.at_least(21) else "policy/v1beta1"


def creates_token_secrets(version: Version) -> bool:
    """Whether the controller manager still makes a token Secret for every ServiceAccount."""
    return not version.at_least(24)


def serves_dra(version: Version) -> bool:
    """Whether the API server serves ``resource.k8s.io/v1`` (DRA GA), which gpushared's DRA mode uses."""
    return version.at_least(34)


def feature_gates(version: Version) -> dict[str, bool]:
    """The gates every component of this version runs with: DRA's consumable capacity where it is alpha."""
    return {"DRAConsumableCapacity": True} if version.at_least(34) and not version.at_least(36) else {}


def feature_gate_flags(version: Version) -> list[str]:
    gates = feature_gates(version)
    if not gates:
        return []
    return ["--feature-gates", ",".join(f"{name}={str(on).lower()}" for name, on in sorted(gates.items()))]


def containerd_cdi(version: Version, *, spec_dirs: list[str]) -> str:
    """The lines of the CRI plugin's section of containerd's (version 2) configuration that turn CDI on and
    name where specs are; empty before 1.7, which has no CDI. (``Version`` reads containerd's own too.)"""
    if (version.major, version.minor) < (1, 7):
        return ""
    dirs = ", ".join(f'"{d}"' for d in spec_dirs)
    return f"enable_cdi = true\n  cdi_spec_dirs = [{dirs}]\n"
