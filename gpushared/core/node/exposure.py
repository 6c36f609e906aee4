"""How a container is given the GPUs its pod was placed on: the part of Allocate's answer runtimes read.

A device plugin does not open GPUs itself; it tells the kubelet what to hand the runtime, and each kind of
runtime reads a different part of the answer (docs/install.md, "How containers get their GPU"):

- ``envvar``: ``NVIDIA_VISIBLE_DEVICES=<UUIDs>``, read by NVIDIA's container runtime hook. Works wherever
  nvidia-container-runtime is the runtime of the pod, but a pod can set that variable itself.
- ``volume-mounts``: the same UUIDs as empty mounts under ``/var/run/nvidia-container-devices``, which the
  hook reads when ``accept-nvidia-visible-devices-as-volume-mounts`` is set: a pod cannot forge a mount
  from its spec the way it can an environment variable, so the hook can ignore the variable.
- ``cdi-cri``: CDI device names (``nvidia.com/gpu=<UUID>``) in the response's ``cdi_devices``; the kubelet
  (>= 1.28) passes them over the CRI and a CDI-enabled runtime (containerd >= 1.7, CRI-O >= 1.23) edits the
  container from the CDI spec that NVIDIA's toolkit wrote. No hook, no variable.
- ``cdi-annotations``: the same names as a container annotation (``cdi.k8s.io/gpushared_gpus``), which
  every kubelet passes to the runtime (the annotations of the device-plugin API are older than 1.20) and a
  CDI-enabled runtime reads as it reads the CRI field: CDI on kubelets before 1.28.

and ``deviceNodes`` (on by default) adds the device files themselves (``/dev/nvidia<minor>`` per GPU,
``/dev/nvidiactl``, ``/dev/nvidia-uvm*``) as device specs, which every runtime honours: the container's
device cgroup lets it open those and only those. Because the runtime itself records them (runc in the
systemd scope's ``DeviceAllow=`` under the systemd cgroup driver), ``systemctl daemon-reload`` does not take
them away, as it does devices NVIDIA's hook adds behind the runtime's back (docs/install.md, "systemctl
daemon-reload").

Pure: the caller says which device files exist on the node.
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

ENV_VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
#: The directory NVIDIA's hook reads device names from with volume-mounts (its ``DeviceListAsVolumeMountsRoot``).
VOLUME_MOUNTS_ROOT: Final = "/var/run/nvidia-container-devices"
#: The CDI kind of NVIDIA's toolkit (``nvidia-ctk cdi generate``); a device is named ``<kind>=<UUID>``.
CDI_KIND: Final = "nvidia.com/gpu"
#: The container annotation that names CDI devices, as the CDI library keys them (``cdi.k8s.io/<plugin>_<id>``).
CDI_ANNOTATION: Final = "cdi.k8s.io/gpushared_gpus"
#: Devices every CUDA process opens besides its GPUs, in the order runtimes create them. Only those present
#: on the node are passed (nvidia-uvm appears once the module loads; nvidia-modeset only with a display).
CONTROL_DEVICES: Final = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


class Strategy(Enum):
    ENVVAR = "envvar"
    VOLUME_MOUNTS = "volume-mounts"
    CDI_CRI = "cdi-cri"
    CDI_ANNOTATIONS = "cdi-annotations"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        try:
            return cls(text.strip())
        except ValueError:
            known = ", ".join(s.value for s in cls)
            raise ValueError(f"unknown device list strategy {text.strip()!r} (known: {known})") from None


@dataclass(frozen=True)
class ExposedGpu:
    uuid: str
    #: /dev/nvidia<minor>; None where NVML gives no minor number (then deviceNodes cannot name its file).
    minor: int | None


@dataclass(frozen=True)
class DeviceFile:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class Exposure:
    envs: dict[str, str]
    #: (container path, host path): read-only bind mounts.
    mounts: tuple[tuple[str, str], ...]
    devices: tuple[DeviceFile, ...]
    cdi_devices: tuple[str, ...]
    #: container annotations for the runtime (``cdi-annotations``)
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def cdi_names(self) -> tuple[str, ...]:
        """NVIDIA's CDI names of the GPUs, whichever way they travel (the CRI field or the annotation)."""
        named = self.annotations.get(CDI_ANNOTATION)
        return self.cdi_devices or (tuple(named.split(",")) if named else ())


@dataclass(frozen=True)
class ExposurePolicy:
    """The node's choice (config ``deviceListStrategy``, ``deviceNodes``, ``devRoot``)."""

    strategies: frozenset[Strategy] = frozenset({Strategy.ENVVAR})
    device_nodes: bool = True
    #: where the node's /dev is, as the daemon sees the host (``/run/nvidia/driver`` under the GPU Operator's
    #: driver container); containers always get /dev/... inside.
    dev_root: str = "/"


class CannotExpose(ValueError):
    """A GPU that the policy cannot name (device nodes wanted, and no minor number known or no file)."""


def exposure(policy: ExposurePolicy, gpus: Sequence[ExposedGpu], *, present: Collection[str]) -> Exposure:
    """What Allocate returns so that the container sees exactly ``gpus``.

    ``present``: which device files (``/dev/nvidia<minor>`` and :data:`CONTROL_DEVICES`, as paths inside the
    container) exist under the node's dev root. A GPU's own file must; control devices are passed if they do.
    """
    uuids = [gpu.uuid for gpu in gpus]
    envs: dict[str, str] = {}
    mounts: list[tuple[str, str]] = []
    if Strategy.ENVVAR in policy.strategies:
        envs[ENV_VISIBLE_DEVICES] = ",".join(uuids)
    if Strategy.VOLUME_MOUNTS in policy.strategies:
        # Alone, the variable names the mounts' directory (the hook's convention). With envvar too it keeps
        # the UUIDs: both then name the same GPUs, whichever the hook is configured to believe.
        envs.setdefault(ENV_VISIBLE_DEVICES, VOLUME_MOUNTS_ROOT)
        mounts += [(posixpath.join(VOLUME_MOUNTS_ROOT, uuid), "/dev/null") for uuid in uuids]
    names = tuple(f"{CDI_KIND}={uuid}" for uuid in uuids)
    cdi = names if Strategy.CDI_CRI in policy.strategies else ()
    annotations = {CDI_ANNOTATION: ",".join(names)} if Strategy.CDI_ANNOTATIONS in policy.strategies and names else {}
    devices: list[DeviceFile] = []
    if policy.device_nodes:
        for gpu in gpus:
            if gpu.minor is None:
                raise CannotExpose(f"GPU {gpu.uuid} has no device minor number in NVML: deviceNodes cannot name it")
            file = _device(policy.dev_root, gpu_device_path(gpu.minor))
            if file.container_path not in present:
                raise CannotExpose(
                    f"GPU {gpu.uuid}'s device file {file.host_path} does not exist: devRoot ({policy.dev_root}) "
                    "is not where the node's /dev is, or the NVIDIA driver has not created the file"
                )
            devices.append(file)
        devices += [_device(policy.dev_root, path) for path in CONTROL_DEVICES if path in present]
    return Exposure(envs=envs, mounts=tuple(mounts), devices=tuple(devices), cdi_devices=cdi, annotations=annotations)


def gpu_device_path(minor: int) -> str:
    """The device file of the GPU with this minor number, as the driver names it."""
    return f"/dev/nvidia{minor}"


def parse_strategies(value: str | Sequence[str]) -> frozenset[Strategy]:
    """Config ``deviceListStrategy``: a YAML list or a comma-separated string (``envvar,cdi-cri``)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    strategies = frozenset(Strategy.parse(str(item)) for item in items if str(item).strip())
    if not strategies:
        raise ValueError("must name at least one device list strategy")
    return strategies


def _device(dev_root: str, path: str) -> DeviceFile:
    return DeviceFile(container_path=path, host_path=posixpath.join(dev_root, path.lstrip("/")))
