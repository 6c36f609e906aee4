"""The node's GPUs as NVML shows them: read each tick of the service loop, and their events watched.

A GPU NVML fails on alone is unhealthy alone and keeps its last reading, so the node's inventory still
lists it; NVML failing as a whole makes every GPU unhealthy until it answers. A GPU with MIG enabled is
never advertised: it cannot be shared by memory. Under systemd, a driver that registered its devices
after the daemon started is outside the unit's device allow-list, and only a restart lets NVML reach it.
"""

from __future__ import annotations

import logging
import os
import threading

from gpushared.core.shared.topology import Link
from gpushared.daemon.errors import RestartNeeded
from gpushared.daemon.health import Health
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.nvml import driver
from gpushared.nvml.backend import GpuBackend, GpuBackendError, GpuDevice, GpuReadError

log = logging.getLogger(__name__)


class GpuReader:
    def __init__(self, backend: GpuBackend, *, health: Health) -> None:
        self.backend = backend
        self.health = health
        #: whether NVML answered the last reading
        self.ok = False
        #: the GPUs the last reading found usable, by index
        self.devices: list[GpuDevice] = []
        #: how the usable GPUs are linked, by index pair; read again only when the GPUs change (links do
        #: not change while the driver runs, and reading them is ~1,000 NVML calls on an 8-GPU node)
        self.links: dict[frozenset[int], Link] = {}
        self._links_of: tuple[tuple[int, str], ...] = ()
        #: systemd starts services with INVOCATION_ID; only there does a restart come, and a device allow-list
        self._under_systemd = "INVOCATION_ID" in os.environ
        self._driver_at_start = driver.loaded_device_groups()
        self._error: str | None = None
        self._mig_refused: set[str] = set()
        self._unnamed: set[int] = set()  # indices of GPUs NVML has failed on since before it ever read them

    def read(self) -> None:
        """Read the GPUs again into ``devices``; raises :class:`RestartNeeded` when only a restart lets NVML
        reach the driver."""
        try:
            if not self.ok:
                self.backend.start()
            gpus, failed = self.backend.devices()
        except GpuBackendError as exc:
            if self._under_systemd and driver.loaded_after_start(self._driver_at_start, driver.loaded_device_groups()):
                raise RestartNeeded(
                    f"NVML: {exc}; the NVIDIA driver registered its devices after gpushared started, so the unit's "
                    "device allow-list (DeviceAllow=char-nvidia*, resolved at start) does not have them: restarting"
                ) from None
            if str(exc) != self._error:  # once per failure, not twice a second on a node without a driver
                log.error("GPUs unreadable: %s; every GPU is unhealthy until NVML answers", exc)
            self.ok, self._error = False, str(exc)
            self.health.backend_failed(str(exc))
            return
        if self._error is not None:
            log.info("NVML answers again")
        self.ok, self._error = True, None
        self.health.backend_ok()
        self._unnamed &= {error.index for error in failed}
        gpus = sorted([*gpus, *self._failed(failed)], key=lambda g: g.index)
        usable = []
        for gpu in gpus:
            if gpu.mig_enabled:
                if gpu.uuid not in self._mig_refused:
                    self._mig_refused.add(gpu.uuid)
                    log.error(
                        "GPU %d (%s) has MIG enabled: gpushared cannot share it by memory; it is not advertised "
                        "(disable MIG with nvidia-smi -i %d -mig 0, or serve it with NVIDIA's MIG device plugin)",
                        gpu.index,
                        gpu.uuid,
                        gpu.index,
                    )
                continue
            usable.append(gpu)
        self.devices = usable
        self._read_links()

    def _read_links(self) -> None:
        which = tuple((gpu.index, gpu.uuid) for gpu in self.devices)
        if which == self._links_of:
            return
        self._links_of = which
        self.links = self.backend.links(self.devices) if len(self.devices) > 1 else {}

    def _failed(self, failed: list[GpuReadError]) -> list[GpuDevice]:
        """GPUs NVML failed on this time: each is unhealthy, alone, and keeps its last reading so the node's
        inventory still lists it; one never read yet cannot be named, and is left out until it is."""
        known = {gpu.index: gpu for gpu in self.devices}
        kept = []
        for error in failed:
            previous = known.get(error.index)
            if previous is None or error.uuid not in (None, previous.uuid):
                if error.index not in self._unnamed:  # once, not twice a second
                    self._unnamed.add(error.index)
                    log.error("GPU %d cannot be read (%s); not advertised until it can", error.index, error.reason)
                continue
            if self.health.gpu_failed(previous.uuid, error.reason):
                log.error(
                    "GPU %d (%s): NVML failed on it (%s); it alone is unhealthy",
                    error.index,
                    previous.uuid,
                    error.reason,
                )
            kept.append(previous)
        return kept

    def watch_events(self, stop: threading.Event, metrics: DaemonMetrics) -> None:
        """XIDs and other GPU events into health, until ``stop``; runs on a thread of its own."""
        while not stop.is_set():
            if not self.ok:
                stop.wait(1.0)
                continue
            try:
                event = self.backend.wait_event(1000)
            except GpuBackendError as exc:
                log.error("GPU event wait failed: %s", exc)
                self.health.backend_failed(str(exc))
                stop.wait(1.0)
                continue
            if event is None:
                continue
            metrics.gpu_events.labels(kind=event.kind, xid=str(event.xid)).inc()
            verdict = self.health.event(
                event.uuid, kind=event.kind, xid=event.xid, all_uuids=[g.uuid for g in self.devices]
            )
            target = event.uuid or "all GPUs"
            if verdict.counts:
                log.error("%s on %s: unhealthy for %.0fs", verdict.reason, target, verdict.seconds)
            else:
                log.info("%s on %s: ignored", verdict.reason, target)
