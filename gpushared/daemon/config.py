"""The daemon's configuration: YAML file, then ``GPUSHARED_*`` environment, then command-line flags.

Every option is declared once in :data:`OPTIONS` with its YAML key, environment name, type and check, so
the three sources cannot drift apart, and a bad value fails at start naming the key and the reason.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from gpushared.contract import ContractError, MemoryUnit
from gpushared.contract.dra import DRIVER
from gpushared.core.node.exposure import ExposurePolicy, Strategy, parse_strategies
from gpushared.core.node.health import APPLICATION_XIDS
from gpushared.core.node.memory import Enforcement, MemoryPolicy

DEFAULT_PATH = Path("/etc/gpushared/config.yaml")
DEFAULT_IGNORED_XIDS = APPLICATION_XIDS
LOG_LEVELS = ("debug", "info", "warning", "error")
#: Where the full status (pod names, GPU UUIDs, paths) is served to local root callers: `gpushared status`.
DEFAULT_STATUS_SOCKET = Path("/run/gpushared/status.sock")
#: Beside dcgm-exporter's 9400, which GPU nodes often run too, not on it (metrics.port where 9402 is taken).
DEFAULT_METRICS_PORT = 9402
#: ``/healthz`` alone, on a listener strangers cannot starve (daemon.healthport): the chart's probes.
DEFAULT_HEALTH_PORT = 9403
#: How the node's GPUs are handed out: to pods asking for gpu-mem through the device plugin (the extender
#: places them), or to ResourceClaims that kube-scheduler allocates itself (Kubernetes >= 1.34). Never both.
MODE_DEVICE_PLUGIN = "device-plugin"
MODE_DRA = "dra"
MODES = (MODE_DEVICE_PLUGIN, MODE_DRA)


class ConfigError(Exception):
    def __init__(self, *, key: str, reason: str, source: str) -> None:
        super().__init__(f"{source}: {key}: {reason}")
        self.key = key


@dataclass(frozen=True)
class Config:
    node_name: str
    kubeconfig: Path
    renewed_token_file: Path | None
    resource_domain: str
    memory_unit: MemoryUnit
    kubelet_dir: Path
    log_level: str
    device_list_strategy: frozenset[Strategy]
    device_nodes: bool
    dev_root: Path
    driver_root: Path
    metrics_address: str
    metrics_port: int
    metrics_health_port: int
    metrics_pod_names: bool
    metrics_socket: Path | None
    health_enabled: bool
    ignored_xids: tuple[int, ...]
    recover_after: float
    mps_enabled: bool
    mps_root: Path
    mps_control: str
    mps_exclusive_process: bool
    mps_shm_size: str
    mps_probe_seconds: float
    gpu_poll_seconds: float
    memory_poll_seconds: float
    memory_enforcement: Enforcement
    memory_grace_seconds: float
    memory_tolerance_mib: int
    memory_reserve_mib: int
    inventory_usage_seconds: float
    mode: str
    dra_driver: str
    cdi_root: Path

    @property
    def dra(self) -> bool:
        """Whether the node's GPUs are served to DRA claims (docs/dra.md) instead of to the device plugin."""
        return self.mode == MODE_DRA

    @property
    def dra_dir(self) -> Path:
        """The driver's own directory in the kubelet's: its socket, lock and checkpoint."""
        return self.kubelet_dir / "plugins" / self.dra_driver

    @property
    def dra_checkpoint(self) -> Path:
        """The prepared claims, one record each, beside the driver's socket."""
        return self.dra_dir / "claims"

    @property
    def dra_legacy_checkpoint(self) -> Path:
        """The single-file checkpoint an earlier daemon wrote, split into records on the first start."""
        return self.dra_dir / "checkpoint.json"

    @property
    def dra_lock(self) -> Path:
        """Held by the one daemon that serves DRA on the node."""
        return self.dra_dir / "driver.lock"

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet_dir / "device-plugins"

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_dir / "pod-resources" / "kubelet.sock"

    @property
    def memory_policy(self) -> MemoryPolicy:
        return MemoryPolicy(
            grace_seconds=self.memory_grace_seconds,
            tolerance_mib=self.memory_tolerance_mib,
            reserve_mib=self.memory_reserve_mib,
        )

    @property
    def exposure(self) -> ExposurePolicy:
        return ExposurePolicy(
            strategies=self.device_list_strategy, device_nodes=self.device_nodes, dev_root=str(self.dev_root)
        )


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return value


def _port(value: Any) -> int:
    number = _integer(value)
    if not 0 <= number <= 65535:
        raise ValueError("must be a port number, 0-65535 (0: no metrics)")
    return number


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("must be an integer")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError("must be an integer") from None


def _seconds(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("must be a number of seconds") from None
    if number < 0:
        raise ValueError("must not be negative")
    return number


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError("must be true or false")


def _shm_size(value: Any) -> str:
    text = str(value).strip()
    if not re.fullmatch(r"[1-9][0-9]*(%|[kmgKMG])?", text) or (text.endswith("%") and int(text[:-1]) > 100):
        raise ValueError("must be a tmpfs size: bytes, a k/m/g suffix, or a percentage of RAM up to 100%")
    return text


def _positive_seconds(value: Any) -> float:
    number = _seconds(value)
    if number == 0:
        raise ValueError("must be more than 0 seconds")
    return number


def _absolute(value: Any) -> Path:
    path = Path(_text(value))
    if not path.is_absolute():
        raise ValueError("must be an absolute path")
    return path


def _optional_path(value: Any) -> Path | None:
    text = _text(value) if value != "" else ""
    if not text:
        return None
    if not text.startswith("/"):
        raise ValueError("must be an absolute path, or empty for none")
    return Path(text)


def _address(value: Any) -> str:
    text = _text(value).strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]  # [::] as URLs write it
    if not re.fullmatch(r"[0-9A-Za-z.:_-]+", text):
        raise ValueError("must be an IP address or a host name (0.0.0.0 or :: for every interface)")
    return text


def _unit(value: Any) -> MemoryUnit:
    try:
        return MemoryUnit.parse(value)
    except ContractError:
        raise ValueError("must be GiB or MiB") from None


def _level(value: Any) -> str:
    if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return value.lower()


def _mode(value: Any) -> str:
    if value not in MODES:
        raise ValueError(f"must be one of {', '.join(MODES)}")
    return str(value)


def _driver_name(value: Any) -> str:
    text = _text(value)
    if len(text) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+", text):
        raise ValueError("must be a DNS subdomain of at most 63 characters, lower case, with a dot (gpu.example.com)")
    return text


def _mib(value: Any) -> int:
    number = _integer(value)
    if number < 0:
        raise ValueError("must be a number of MiB, 0 or more")
    return number


def _enforcement(value: Any) -> Enforcement:
    try:
        return Enforcement.parse(str(value))
    except ContractError:
        raise ValueError("must be off, report or kill") from None


def _xids(value: Any) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError("must be a list of XID numbers")
    return tuple(sorted({_integer(str(x).strip()) for x in items if str(x).strip()}))


@dataclass(frozen=True)
class Option:
    field: str
    key: str  # dotted YAML path
    parse: Callable[[Any], Any]
    default: Callable[[], Any]

    @property
    def env(self) -> str:
        """``health.recoverAfterSeconds`` -> ``GPUSHARED_HEALTH_RECOVER_AFTER_SECONDS``; ``MiB`` is one word."""
        key = self.key.replace("MiB", "Mib")
        return "GPUSHARED_" + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).replace(".", "_").upper()


OPTIONS = (
    Option("node_name", "nodeName", _text, socket.gethostname),
    Option("kubeconfig", "kubeconfig", lambda v: Path(_text(v)), lambda: Path("/etc/gpushared/kubeconfig")),
    Option("renewed_token_file", "renewedTokenFile", _optional_path, lambda: Path("/var/lib/gpushared/token")),
    Option("resource_domain", "resourceDomain", _text, lambda: "aliyun.com"),
    Option("memory_unit", "memoryUnit", _unit, lambda: MemoryUnit.GIB),
    Option("kubelet_dir", "kubeletDir", lambda v: Path(_text(v)), lambda: Path("/var/lib/kubelet")),
    Option("log_level", "logLevel", _level, lambda: "info"),
    Option("device_list_strategy", "deviceListStrategy", parse_strategies, lambda: frozenset({Strategy.ENVVAR})),
    Option("device_nodes", "deviceNodes", _boolean, lambda: True),
    Option("dev_root", "devRoot", _absolute, lambda: Path("/")),
    Option("driver_root", "driverRoot", _absolute, lambda: Path("/")),
    Option("metrics_address", "metrics.address", _address, lambda: "0.0.0.0"),
    Option("metrics_port", "metrics.port", _port, lambda: DEFAULT_METRICS_PORT),
    Option("metrics_health_port", "metrics.healthPort", _port, lambda: DEFAULT_HEALTH_PORT),
    Option("metrics_pod_names", "metrics.podNames", _boolean, lambda: False),
    Option("metrics_socket", "metrics.socket", _optional_path, lambda: DEFAULT_STATUS_SOCKET),
    Option("health_enabled", "health.enabled", _boolean, lambda: True),
    Option("ignored_xids", "health.ignoredXids", _xids, lambda: DEFAULT_IGNORED_XIDS),
    Option("recover_after", "health.recoverAfterSeconds", _seconds, lambda: 300.0),
    Option("mps_enabled", "mps.enabled", _boolean, lambda: False),
    Option("mps_root", "mps.root", lambda v: Path(_text(v)), lambda: Path("/run/gpushared/mps")),
    Option("mps_control", "mps.controlBinary", _text, lambda: "nvidia-cuda-mps-control"),
    Option("mps_exclusive_process", "mps.exclusiveProcess", _boolean, lambda: False),
    Option("mps_shm_size", "mps.shmSize", _shm_size, lambda: "50%"),
    Option("mps_probe_seconds", "mps.probeSeconds", _positive_seconds, lambda: 5.0),
    Option("gpu_poll_seconds", "gpuPollSeconds", _positive_seconds, lambda: 5.0),
    Option("memory_poll_seconds", "memoryPollSeconds", _positive_seconds, lambda: 2.0),
    Option("memory_enforcement", "memoryEnforcement", _enforcement, lambda: Enforcement.REPORT),
    Option("memory_grace_seconds", "memoryGraceSeconds", _seconds, lambda: 10.0),
    Option("memory_tolerance_mib", "memoryToleranceMiB", _mib, lambda: 256),
    Option("memory_reserve_mib", "memoryReserveMiB", _mib, lambda: 512),
    Option("inventory_usage_seconds", "inventoryUsageSeconds", _positive_seconds, lambda: 60.0),
    Option("mode", "mode", _mode, lambda: MODE_DEVICE_PLUGIN),
    Option("dra_driver", "dra.driverName", _driver_name, lambda: DRIVER),
    Option("cdi_root", "dra.cdiRoot", _absolute, lambda: Path("/var/run/cdi")),
)
assert {o.field for o in OPTIONS} == {f.name for f in fields(Config)}


def load(
    path: Path = DEFAULT_PATH,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    required: bool = False,
) -> Config:
    """The effective configuration. A missing file is fine unless ``required`` (it was named on purpose)."""
    env = os.environ if env is None else env
    document: dict[str, Any] = {}
    if path.exists():
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(key="(file)", reason=f"not valid YAML: {exc}", source=str(path)) from None
        if not isinstance(loaded, dict):
            raise ConfigError(key="(file)", reason="must be a mapping of options", source=str(path))
        document = loaded
    elif required:
        raise ConfigError(key="(file)", reason="no such file", source=str(path))
    _reject_unknown(document, source=str(path))
    values: dict[str, Any] = {}
    for option in OPTIONS:
        raw, source = _lookup(document, option.key), str(path)
        if option.env in env:
            raw, source = env[option.env], f"environment {option.env}"
        if flags and flags.get(option.field) is not None:
            raw, source = flags[option.field], "command line"
        if raw is None:
            values[option.field] = option.default()
            continue
        try:
            values[option.field] = option.parse(raw)
        except ValueError as exc:
            raise ConfigError(key=option.key, reason=f"{exc} (got {raw!r})", source=source) from None
    return Config(**values)


def _lookup(document: dict[str, Any], key: str) -> Any:
    node: Any = document
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _reject_unknown(document: dict[str, Any], *, source: str, prefix: str = "") -> None:
    """A misspelt key would silently fall back to its default: refuse it instead."""
    known = {o.key for o in OPTIONS}
    for key, value in document.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and any(k.startswith(dotted + ".") for k in known):
            _reject_unknown(value, source=source, prefix=dotted + ".")
        elif dotted not in known:
            raise ConfigError(key=dotted, reason="unknown option", source=source)
