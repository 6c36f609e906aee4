"""GPU discovery and health events, behind an interface the daemon can run without a GPU.

The daemon needs four things from the driver: the GPUs (index, UUID, model, memory, MIG mode), whether it
can serve MPS on them, and critical events (XIDs, ECC). :class:`NvmlBackend` gets them from pynvml; on a
machine without NVIDIA's library the same code runs against the fake ``libnvidia-ml.so.1`` of the tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

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
