"""The daemon's configuration: file, environment and flags, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushared.contract import MemoryUnit
from gpushared.core.node.exposure import ExposurePolicy, Strategy
from gpushared.daemon.config import DEFAULT_IGNORED_XIDS, ConfigError, load


def test_defaults_without_a_file(tmp_path: Path) -> None:
    config = load(tmp_path / "missing.yaml", env={})
    assert config.memory_unit is MemoryUnit.GIB
    assert config.kubeconfig == Path("/etc/gpushared/kubeconfig")
    assert config.plugin_dir == Path("/var/lib/kubelet/device-plugins")
    assert config.pod_resources_socket == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    # Scrapable from the cluster, and not on dcgm-exporter's 9400.
    assert (config.metrics_address, config.metrics_port) == ("0.0.0.0", 9402)
    assert config.exposure == ExposurePolicy(strategies=frozenset({Strategy.ENVVAR}), device_nodes=True, dev_root="/")
    assert config.driver_root == Path("/")
    assert config.ignored_xids == DEFAULT_IGNORED_XIDS
    assert config.node_name  # the hostname


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "nodeName: from-file\nmemoryUnit: MiB\nhealth:\n  ignoredXids: [13, 94]\n  recoverAfterSeconds: 60\n"
    )
    config = load(path, env={"GPUSHARED_NODE_NAME": "from-env", "GPUSHARED_HEALTH_IGNORED_XIDS": "13,31"})
    assert (config.node_name, config.memory_unit, config.ignored_xids, config.recover_after) == (
        "from-env",
        MemoryUnit.MIB,
        (13, 31),
        60.0,
    )
    flagged = load(path, env={"GPUSHARED_NODE_NAME": "from-env"}, flags={"node_name": "from-flag", "log_level": None})
    assert flagged.node_name == "from-flag"


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("memoryUnit: GB\n", {}, r"config.yaml: memoryUnit: must be GiB or MiB \(got 'GB'\)"),
        ("metrics:\n  port: 70000\n", {}, "metrics.port: must be a port number"),
        ("health:\n  recoverAfterSeconds: -1\n", {}, "health.recoverAfterSeconds: must not be negative"),
        ("logLevel: loud\n", {}, "logLevel: must be one of debug, info, warning, error"),
        ("nodename: x\n", {}, "nodename: unknown option"),
        ("health:\n  ignoredXid: [1]\n", {}, r"health\.ignoredXid: unknown option"),
        ("[1, 2]\n", {}, "must be a mapping of options"),
        ("a: [\n", {}, "not valid YAML"),
        ("", {"GPUSHARED_METRICS_PORT": "x"}, "environment GPUSHARED_METRICS_PORT: metrics.port: must be an integer"),
        ("", {"GPUSHARED_HEALTH_ENABLED": "maybe"}, "health.enabled: must be true or false"),
        ("deviceListStrategy: nvml\n", {}, "deviceListStrategy: unknown device list strategy 'nvml' \\(known: envvar"),
        ("deviceListStrategy: []\n", {}, "deviceListStrategy: must name at least one"),
        ("devRoot: run/nvidia\n", {}, "devRoot: must be an absolute path"),
        ("metrics:\n  address: 'http://x'\n", {}, "metrics.address: must be an IP address or a host name"),
    ],
)
def test_bad_values_name_the_key_and_the_source(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(path, env=env)


def test_a_named_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load(tmp_path / "nope.yaml", env={}, required=True)


def test_mps_options(tmp_path: Path) -> None:
    defaults = load(tmp_path / "missing.yaml", env={})
    assert (defaults.mps_enabled, defaults.mps_root, defaults.mps_exclusive_process) == (
        False,
        Path("/run/gpushared/mps"),
        False,
    )
    assert (defaults.mps_control, defaults.mps_shm_size, defaults.mps_probe_seconds) == (
        "nvidia-cuda-mps-control",
        "50%",
        5.0,
    )
    path = tmp_path / "config.yaml"
    path.write_text("mps:\n  enabled: true\n  shmSize: 8g\n  exclusiveProcess: yes\n")
    config = load(path, env={"GPUSHARED_MPS_PROBE_SECONDS": "1.5"})
    assert (config.mps_enabled, config.mps_shm_size, config.mps_exclusive_process) == (True, "8g", True)
    assert config.mps_probe_seconds == 1.5


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("mps:\n  shmSize: lots\n", "mps.shmSize", "must be a tmpfs size"),
        ("mps:\n  shmSize: 150%\n", "mps.shmSize", "percentage of RAM up to 100%"),
        ("mps:\n  probeSeconds: 0\n", "mps.probeSeconds", "more than 0 seconds"),
        ("mps:\n  enable: true\n", "mps.enable", "unknown option"),
    ],
)
def test_bad_mps_options_name_the_key(tmp_path: Path, text: str, key: str, reason: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=reason) as info:
        load(path, env={})
    assert info.value.key == key


def test_the_shipped_config_names_every_option() -> None:
    """packaging/deb/config.yaml is the conffile users edit: it must not drift from the options."""
    import re

    from gpushared.daemon.config import OPTIONS

    text = (Path(__file__).resolve().parents[2] / "packaging" / "deb" / "config.yaml").read_text()
    for option in OPTIONS:
        leaf = option.key.rsplit(".", 1)[-1]
        assert re.search(rf"^#\s*{leaf}:", text, re.MULTILINE), f"{option.key} missing from the shipped config"


def test_device_exposure_options(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "deviceListStrategy: [cdi-cri, volume-mounts]\ndeviceNodes: true\ndevRoot: /run/nvidia/driver\n"
        "driverRoot: /run/nvidia/driver\nmetrics:\n  address: '[::]'\n"
    )
    config = load(path, env={})
    assert config.exposure == ExposurePolicy(
        strategies=frozenset({Strategy.CDI_CRI, Strategy.VOLUME_MOUNTS}),
        device_nodes=True,
        dev_root="/run/nvidia/driver",
    )
    assert (config.driver_root, config.metrics_address) == (Path("/run/nvidia/driver"), "::")
    from_env = load(path, env={"GPUSHARED_DEVICE_LIST_STRATEGY": "envvar,cdi-cri"})
    assert from_env.device_list_strategy == frozenset({Strategy.ENVVAR, Strategy.CDI_CRI})
