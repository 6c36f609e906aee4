"""GPU discovery and health events, behind an interface the daemon can run without a GPU.

The daemon needs five things from the driver: the GPUs (index, UUID, model, memory, MIG mode, PCI address,
NUMA node), how they are linked, whether it can serve MPS on them, and critical events (XIDs, ECC).
:class:`NvmlBackend` gets them from pynvml; on a machine without NVIDIA's library the same code runs
against the fake ``libnvidia-ml.so.1`` of the tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pynvml

from gpushared.core.shared.topology import Link, LinkKind
from gpushared.nvml import driver


class GpuBackendError(Exception):
    """NVML failed: the driver is missing, a GPU is lost, or a call is not supported."""


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    model: str
    memory_mib: int
    mig_enabled: bool
    compute_capability: tuple[int, int]
    #: the N of /dev/nvidiaN (deviceNodes); None where the driver does not say.
    minor: int | None = None
    #: NVML's "domain:bus:device.function" ("00000000:07:00.0"); None where the driver does not say.
    pci_bus_id: str | None = None
    #: the NUMA node of the GPU's PCIe root; None where neither NVML nor sysfs says.
    numa: int | None = None


@dataclass(frozen=True)
class GpuReadError:
    """One GPU NVML could not read; ``uuid`` is None when not even its UUID could be."""

    index: int
    uuid: str | None
    reason: str


@dataclass(frozen=True)
class NvmlProcess:
    """A process NVML lists on a GPU, by its host PID, with the memory it holds there."""

    pid: int
    #: None where the driver cannot say (NVML_VALUE_NOT_AVAILABLE)
    used_mib: int | None
    graphics: bool = False


@dataclass(frozen=True)
class GpuEvent:
    """A critical event; ``uuid`` is None when the driver could not attribute it to one GPU."""

    uuid: str | None
    kind: str  # "xid", "sbe", "dbe"
    xid: int


class GpuBackend(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def devices(self) -> tuple[list[GpuDevice], list[GpuReadError]]: ...
    def wait_event(self, timeout_ms: int) -> GpuEvent | None: ...
    def driver_version(self) -> str: ...
    def set_exclusive_process(self, uuid: str, exclusive: bool) -> None: ...
    def processes(self, uuid: str) -> list[NvmlProcess]: ...
    def sm_use(self, uuid: str, since_us: int) -> tuple[dict[int, int], int]: ...
    def links(self, gpus: list[GpuDevice]) -> dict[frozenset[int], Link]: ...


_EVENT_KINDS = {
    pynvml.nvmlEventTypeXidCriticalError: "xid",
    pynvml.nvmlEventTypeSingleBitEccError: "sbe",
    pynvml.nvmlEventTypeDoubleBitEccError: "dbe",
}


class NvmlBackend:
    """pynvml, with every NVML error turned into :class:`GpuBackendError` carrying NVML's own words."""

    def __init__(self, *, driver_root: str = "/") -> None:
        self._lock = threading.Lock()
        self._events: object | None = None
        self._started = False
        self.driver_root = driver_root

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            try:
                self._load_from_driver_root()
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                raise GpuBackendError(
                    f"NVML could not start: {exc} (is the NVIDIA driver installed and loaded?)"
                ) from exc
            self._started = True
            self._events = None

    def _load_from_driver_root(self) -> None:
        """pynvml loads ``libnvidia-ml.so.1`` by name; under a driver root it must be that root's library."""
        if driver.on_host(self.driver_root) or pynvml.nvmlLib is not None:
            return
        directory = driver.library_dir(self.driver_root)
        if directory is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        try:
            pynvml.nvmlLib = ctypes.CDLL(os.path.join(directory, driver.NVML_LIBRARY))
        except OSError:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND) from None

    def stop(self) -> None:
        with self._lock:
            if not self._started:
                return
            if self._events is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(self._events)
            self._events = None
            self._started = False
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()

    def driver_version(self) -> str:
        try:
            return str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as exc:
            raise GpuBackendError(f"nvmlSystemGetDriverVersion: {exc}") from exc

    def devices(self) -> tuple[list[GpuDevice], list[GpuReadError]]:
        """The GPUs NVML reads, and the ones it fails on, each on its own: one lost GPU (its memory info
        answering GPU_IS_LOST) must not take the node's other GPUs with it. Raises only when NVML cannot
        even count them."""
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            raise GpuBackendError(f"reading GPUs: {exc}") from exc
        found: list[GpuDevice] = []
        failed: list[GpuReadError] = []
        for index in range(count):
            uuid: str | None = None
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = str(pynvml.nvmlDeviceGetUUID(handle))
                found.append(
                    GpuDevice(
                        index=index,
                        uuid=uuid,
                        model=str(pynvml.nvmlDeviceGetName(handle)),
                        memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20,
                        mig_enabled=_mig_enabled(handle),
                        compute_capability=_capability(handle),
                        minor=_minor(handle),
                        pci_bus_id=(bus := _bus_id(handle)),
                        numa=_numa(handle, bus),
                    )
                )
            except pynvml.NVMLError as exc:
                failed.append(GpuReadError(index=index, uuid=uuid, reason=str(exc)))
        return found, failed

    def set_exclusive_process(self, uuid: str, exclusive: bool) -> None:
        """Compute mode EXCLUSIVE_PROCESS (only the MPS server may open a context) or DEFAULT again."""
        mode = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS if exclusive else pynvml.NVML_COMPUTEMODE_DEFAULT
        try:
            pynvml.nvmlDeviceSetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid), mode)
        except pynvml.NVMLError as exc:
            raise GpuBackendError(f"setting the compute mode of {uuid}: {exc}") from exc

    def processes(self, uuid: str) -> list[NvmlProcess]:
        """The compute and graphics processes on the GPU, through the newest call the driver has (``_v3``,
        else ``_v2``). A process with contexts of both kinds is listed once, with the larger amount."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            found: dict[int, NvmlProcess] = {}
            for graphics, calls in ((False, _COMPUTE_CALLS), (True, _GRAPHICS_CALLS)):
                for info in _newest(calls, handle):
                    used = None if info.usedGpuMemory is None else int(info.usedGpuMemory) // 2**20
                    known = found.get(int(info.pid))
                    if known is None or (used or 0) > (known.used_mib or 0):
                        found[int(info.pid)] = NvmlProcess(pid=int(info.pid), used_mib=used, graphics=graphics)
        except pynvml.NVMLError as exc:
            raise GpuBackendError(f"reading the processes of {uuid}: {exc}") from exc
        return sorted(found.values(), key=lambda p: p.pid)

    def sm_use(self, uuid: str, since_us: int) -> tuple[dict[int, int], int]:
        """Each process's SM use (%) in the driver's samples since ``since_us`` (its timestamps, in µs): the
        largest sample of each PID, and the newest timestamp, for the next call. Nothing when no process
        ran since, or the driver keeps no samples (NOT_FOUND, NOT_SUPPORTED)."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED):
                return {}, since_us  # (pynvml raises SUCCESS when the driver had no samples to size)
            raise GpuBackendError(f"reading the SM use of {uuid}'s processes: {exc}") from exc
        use: dict[int, int] = {}
        newest = since_us
        for sample in samples:
            pid = int(sample.pid)
            use[pid] = max(use.get(pid, 0), int(sample.smUtil))
            newest = max(newest, int(sample.timeStamp))
        return use, newest

    def links(self, gpus: list[GpuDevice]) -> dict[frozenset[int], Link]:
        """How each pair of ``gpus`` is linked, by NVML index, as ``nvidia-smi topo -m`` shows it: NVLink with
        its count of active links, else the closest PCIe ancestor they share. Links through NVSwitches join
        every two GPUs on the fabric, each pair by as many links as the less-linked of the two has to the
        switches (an A100 in a DGX: 12). A pair the driver says nothing about (older drivers answer
        NOT_SUPPORTED) is :attr:`LinkKind.UNKNOWN`; a GPU NVML fails on has unknown links, not an error."""
        with_bus = [gpu for gpu in gpus if gpu.pci_bus_id is not None]
        by_bus = {_bus_key(gpu.pci_bus_id): gpu.index for gpu in with_bus if gpu.pci_bus_id}
        direct: dict[tuple[int, int], int] = {}  # (GPU, peer) -> links the GPU says go to the peer
        to_switch: dict[int, int] = {}
        handles: dict[int, object] = {}
        for gpu in with_bus:
            try:
                handles[gpu.index] = handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            except pynvml.NVMLError:
                continue
            for remote in _nvlink_remotes(handle):
                peer = by_bus.get(_bus_key(remote.bus_id))
                if peer is not None and peer != gpu.index:
                    direct[gpu.index, peer] = direct.get((gpu.index, peer), 0) + 1
                elif peer is None and remote.switch:
                    to_switch[gpu.index] = to_switch.get(gpu.index, 0) + 1
        links: dict[frozenset[int], Link] = {}
        indices = sorted(handles)
        for i, a in enumerate(indices):
            for b in indices[i + 1 :]:
                # Both ends see the same links; one end NVML failed on still has them counted by the other.
                count = max(direct.get((a, b), 0), direct.get((b, a), 0))
                count += min(to_switch.get(a, 0), to_switch.get(b, 0))
                links[frozenset((a, b))] = Link(LinkKind.NVLINK, count) if count else _pcie_link(handles[a], handles[b])
        return links

    def wait_event(self, timeout_ms: int) -> GpuEvent | None:
        """The next critical event, or None after ``timeout_ms``. Registers on first use."""
        try:
            if self._events is None:
                self._events = self._register()
            data = pynvml.nvmlEventSetWait(self._events, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        except pynvml.NVMLError as exc:
            self._events = None
            raise GpuBackendError(f"waiting for GPU events: {exc}") from exc
        uuid = str(pynvml.nvmlDeviceGetUUID(data.device)) if data.device else None
        return GpuEvent(uuid=uuid, kind=_EVENT_KINDS.get(data.eventType, "xid"), xid=int(data.eventData))

    def _register(self) -> object:
        events = pynvml.nvmlEventSetCreate()
        wanted = sum(_EVENT_KINDS)
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            pynvml.nvmlDeviceRegisterEvents(handle, wanted & supported, events)
        return events


_COMPUTE_CALLS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
_GRAPHICS_CALLS = ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2")


def _newest(calls: tuple[str, ...], handle: object) -> list[Any]:
    """The first of ``calls`` (newest first) that the driver has."""
    for name in calls[:-1]:
        try:
            return list(getattr(pynvml, name)(handle))
        except pynvml.NVMLError_FunctionNotFound:
            continue
    return list(getattr(pynvml, calls[-1])(handle))


#: nvmlDeviceGetTopologyCommonAncestor's levels, as nvidia-smi names them.
_ANCESTORS: dict[int, LinkKind] = {
    pynvml.NVML_TOPOLOGY_INTERNAL: LinkKind.SAME_BOARD,
    pynvml.NVML_TOPOLOGY_SINGLE: LinkKind.SINGLE_SWITCH,
    pynvml.NVML_TOPOLOGY_MULTIPLE: LinkKind.MULTIPLE_SWITCHES,
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: LinkKind.HOST_BRIDGE,
    pynvml.NVML_TOPOLOGY_NODE: LinkKind.SAME_CPU,
    pynvml.NVML_TOPOLOGY_SYSTEM: LinkKind.CROSS_CPU,
}


@dataclass(frozen=True)
class _Remote:
    bus_id: str
    switch: bool


def _nvlink_remotes(handle: object) -> list[_Remote]:
    """The far end of each active NVLink link of a GPU. A GPU has fewer links than NVML's maximum: the
    links it lacks answer NOT_SUPPORTED or INVALID_ARGUMENT, and one failing link does not hide the rest."""
    remotes = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            bus_id = _text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except pynvml.NVMLError:
            continue
        try:
            kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            switch = kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        except pynvml.NVMLError:  # drivers before r450 do not say; a far end that is no GPU is a switch there
            switch = True
        remotes.append(_Remote(bus_id, switch))
    return remotes


def _pcie_link(a: object, b: object) -> Link:
    try:
        level = pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    except pynvml.NVMLError:
        return Link(LinkKind.UNKNOWN)
    return Link(_ANCESTORS.get(int(level), LinkKind.UNKNOWN))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bus_key(bus_id: str) -> str:
    """A PCI address compared across NVML's spellings: the 8- or 4-digit domain, any case."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest else domain


def _bus_id(handle: object) -> str | None:
    try:
        return _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    except pynvml.NVMLError:
        return None


#: The kernel's view of PCI devices: ``<domain>:<bus>:<device>.<function>/numa_node``.
SYSFS_PCI = Path("/sys/bus/pci/devices")


def _numa(handle: object, bus_id: str | None) -> int | None:
    """The NUMA node closest to the GPU, as ``nvidia-smi topo -m`` prints it under "NUMA Affinity".

    NVML's memory affinity at node scope first: the nodes whose memory is nearest the GPU, one bit each; a
    single node is the answer, several (a GPU equally near all of them) say nothing. Then the kernel's
    ``numa_node`` for the GPU's PCI address, which is -1 in most VMs and on one-node machines.
    ``nvmlDeviceGetNumaNodeId`` is not it: that is the NUMA node *of the GPU's own memory* on platforms where
    the GPU is one (Grace Hopper), and NOT_SUPPORTED elsewhere (an H100 on PCIe, driver 580, answered so while
    its memory affinity named node 0; docs/gpu-checks.md).
    """
    try:
        mask = pynvml.nvmlDeviceGetMemoryAffinity(handle, 1, pynvml.NVML_AFFINITY_SCOPE_NODE)
        nodes = [64 * word + bit for word, bits in enumerate(mask) for bit in range(64) if bits >> bit & 1]
        if len(nodes) == 1:
            return nodes[0]
    except pynvml.NVMLError:
        pass
    if bus_id is None:
        return None
    try:
        node = int((SYSFS_PCI / _bus_key(bus_id) / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _mig_enabled(handle: object) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return False
    return bool(current)


def _capability(handle: object) -> tuple[int, int]:
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    return int(major), int(minor)


def _minor(handle: object) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))
    except pynvml.NVMLError:
        return None
