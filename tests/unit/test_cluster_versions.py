"""The local cluster's flags and configs chosen by the Kubernetes binaries' version (tests/e2e/versions.py).

A flag a binary no longer knows stops it at once, so each row is what that version accepts: 1.20 (Debian,
CI), 1.24 (insecure ports and token Secrets gone), 1.29 (v1 scheduler config, CRI endpoint in the
kubelet's config) and 1.36 (no sandbox-image flag, cgroup v1 refused unless allowed)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.builders import scheduler_config
from tests.e2e import versions
from tests.e2e.versions import SCHEDULER_V1, SCHEDULER_V1BETA1, Version

ENDPOINT = "unix:///run/containerd.sock"
PAUSE = "localhost/pause:3.2"
RUNTIME_FLAGS = ["--container-runtime", "remote", "--container-runtime-endpoint", ENDPOINT]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Kubernetes v1.20.2", Version(1, 20, 2)),
        ("Kubernetes v1.36.0-alpha.1\n", Version(1, 36, 0)),
        ("v1.29.4+k3s1", Version(1, 29, 4)),
        ("1.24", Version(1, 24, 0)),
    ],
)
def test_the_version_is_read_from_what_the_binary_prints(text: str, expected: Version) -> None:
    assert Version.parse(text) == expected


def test_text_without_a_version_is_an_error_not_a_guess() -> None:
    with pytest.raises(ValueError, match="no Kubernetes version"):
        Version.parse("kubelet: command not found")


# version: apiserver flags, controller-manager/scheduler flags, token Secrets, scheduler API, shipped file,
# PodDisruptionBudget API
CONTROL_PLANE = {
    "1.20.2": (["--insecure-port", "0"], ["--port", "0"], True, "v1beta1", SCHEDULER_V1BETA1, "policy/v1beta1"),
    "1.24.17": ([], [], False, "v1beta3", SCHEDULER_V1, "policy/v1"),
    "1.29.4": ([], [], False, "v1", SCHEDULER_V1, "policy/v1"),
    "1.36.0": ([], [], False, "v1", SCHEDULER_V1, "policy/v1"),
}


@pytest.mark.parametrize("version", CONTROL_PLANE)
def test_control_plane_flags_and_scheduler_config_by_version(version: str) -> None:
    apiserver, insecure, tokens, api, shipped, pdb = CONTROL_PLANE[version]
    v = Version.parse(version)
    assert versions.apiserver_flags(v) == apiserver
    assert versions.insecure_port_flags(v) == insecure
    assert versions.creates_token_secrets(v) is tokens
    chosen = versions.scheduler_api(v)
    assert chosen.api_version == f"kubescheduler.config.k8s.io/{api}"
    assert chosen.shipped == shipped
    assert versions.pdb_api(v) == pdb


# version, cgroup v1 host, kubelet flags, KubeletConfiguration fields
KUBELET = [
    (
        "1.20.2",
        True,
        [*RUNTIME_FLAGS, "--pod-infra-container-image", PAUSE],
        {},
    ),
    (
        "1.24.17",
        False,
        [*RUNTIME_FLAGS, "--pod-infra-container-image", PAUSE],
        {},
    ),
    ("1.29.4", True, ["--pod-infra-container-image", PAUSE], {"containerRuntimeEndpoint": ENDPOINT}),
    (
        "1.34.1",
        False,
        ["--pod-infra-container-image", PAUSE],
        {"containerRuntimeEndpoint": ENDPOINT, "featureGates": {"DRAConsumableCapacity": True}},
    ),
    ("1.36.0", True, [], {"containerRuntimeEndpoint": ENDPOINT, "failCgroupV1": False}),
    ("1.36.0", False, [], {"containerRuntimeEndpoint": ENDPOINT}),
]


@pytest.mark.parametrize(("version", "cgroup_v1", "flags", "config"), KUBELET)
def test_kubelet_flags_and_config_by_version(version: str, cgroup_v1: bool, flags: list[str], config: dict) -> None:
    chosen = versions.kubelet(Version.parse(version), runtime_endpoint=ENDPOINT, pause_image=PAUSE, cgroup_v1=cgroup_v1)
    assert chosen.flags == flags
    assert chosen.config == config


@pytest.mark.parametrize("version", ["1.20.2", "1.24.17", "1.29.4", "1.36.0"])
def test_the_scheduler_runs_the_shipped_file_with_only_the_harness_fields_changed(version: str) -> None:
    """From 1.25 the document is deploy/control-plane/scheduler-config.yaml itself; before, its API version differs and
    1.20's v1beta1 keeps the health addresses. The extenders are what the harness passes (its address)."""
    chosen = versions.scheduler_api(Version.parse(version))
    extenders = [{"urlPrefix": "https://127.0.0.1:1/gpushare-scheduler"}]
    body = chosen.document(extenders=extenders, kubeconfig="/k", health="127.0.0.1:2")
    shipped = yaml.safe_load(chosen.shipped.read_text())
    changed = {key for key in body if body[key] != shipped.get(key)}
    expected = {"clientConnection", "leaderElection", "extenders"}
    if chosen.api_version != shipped["apiVersion"]:
        expected.add("apiVersion")
    if chosen.bind_addresses:
        expected |= {"healthzBindAddress", "metricsBindAddress"}
    assert changed == expected
    assert body["extenders"] == extenders
    assert ("healthzBindAddress" in body) is (version == "1.20.2")


def test_v1beta3_and_v1_files_carry_the_same_extender_fields() -> None:
    """1.23-1.24 run the v1 file under v1beta3: that holds only while the extender entries are the same, but for
    GPU memory, which the 1.19-1.22 file leaves to the extender (some of those kube-schedulers never call the
    preempt verb) and the v1 file lets kube-scheduler count (its preemption asks the verb)."""

    def gpu_mem_ignored(extenders: list[dict[str, Any]]) -> list[bool]:
        return [
            r.pop("ignoredByScheduler")
            for e in extenders
            for r in e.get("managedResources", [])
            if r["name"].endswith("gpu-mem")
        ]

    v1, v1beta1 = scheduler_config(SCHEDULER_V1)["extenders"], scheduler_config(SCHEDULER_V1BETA1)["extenders"]
    assert (gpu_mem_ignored(v1), gpu_mem_ignored(v1beta1)) == ([False], [True])
    assert v1 == v1beta1


@pytest.mark.parametrize(
    ("version", "dra", "flags"),
    [
        ("1.20.2", False, []),
        ("1.33.5", False, []),
        ("1.34.1", True, ["--feature-gates", "DRAConsumableCapacity=true"]),
        ("1.35.0", True, ["--feature-gates", "DRAConsumableCapacity=true"]),
        ("1.36.2", True, []),
    ],
)
def test_dra_and_its_consumable_capacity_by_version(version: str, dra: bool, flags: list[str]) -> None:
    v = Version.parse(version)
    assert versions.serves_dra(v) is dra
    assert versions.feature_gate_flags(v) == flags


@pytest.mark.parametrize(
    ("text", "on"),
    [
        ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+b1", False),
        ("containerd 1.7.24~ds1", True),
    ],
)
def test_cdi_in_containerd_from_1_7(text: str, on: bool) -> None:
    lines = versions.containerd_cdi(Version.parse(text), spec_dirs=["/x/cdi"])
    assert bool(lines) is on
    if on:
        assert lines == 'enable_cdi = true\n  cdi_spec_dirs = ["/x/cdi"]\n'
