"""Supervision of one MPS control daemon per GPU (what an MPS pod's container gets is core.node.allocate).

The daemons must outlive gpushared: ``quit`` cuts every client of the GPU off, so a gpushared restart or
upgrade must not restart them. On start we therefore *adopt* a daemon that answers on its control socket,
and only start one where none answers. A daemon that stops answering (dead, or hung past the probe
timeout) makes its GPU unhealthy until a restarted one answers again; restarts back off exponentially.
``gpushared mps stop`` leaves a marker that keeps the supervisor from starting that daemon again.

The daemon's defaults are set to the ceiling (all threads, the whole GPU's memory) and each MPS container
is narrowed with env, because a client's env can only narrow the daemon's limits, never widen them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushared.core.node.allocate import MpsDaemon
from gpushared.daemon.config import Config
from gpushared.daemon.health import Health
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.mps.control import GpuDirs, MpsControl, MpsError, host_mount_namespace
from gpushared.nvml import driver
from gpushared.nvml.backend import GpuBackend, GpuBackendError, GpuDevice

log = logging.getLogger(__name__)

MAX_BACKOFF = 60.0
#: How long a control daemon found running at start may stay silent before it is replaced: it may be busy
#: (an upgrade under load, a client's command holding the pipe), and replacing it cuts off every MPS client.
ADOPT_GRACE_SECONDS = 15.0
#: Tries of `quit` while the daemon still runs ("Cannot send command" when another client holds its pipe).
QUIT_ATTEMPTS = 3


@dataclass(frozen=True)
class MpsSettings:
    root: Path
    binary: str
    exclusive_process: bool
    shm_size: str
    probe_seconds: float
    #: the driver root's library directory, when the driver is not the host's (config driverRoot)
    library_path: str | None = None

    def control(self, uuid: str, *, timeout: float = 5.0) -> MpsControl:
        return MpsControl(
            binary=self.binary,
            uuid=uuid,
            dirs=GpuDirs.of(self.root, uuid),
            timeout=timeout,
            library_path=self.library_path,
        )


@dataclass
class GpuDaemon:
    """What the supervisor knows of one GPU's daemon."""

    gpu: GpuDevice
    control: MpsControl
    pid: int | None = None
    state: str = "starting"  # starting | running | failed | stopped
    problem: str | None = None
    restarts: int = 0
    adopted: bool = False
    backoff: float = 1.0
    next_start: float = 0.0
    since: float = 0.0  # when it last became running
    #: until when a daemon found running at start is asked again before it is replaced (None: not yet asked)
    adopt_until: float | None = None
    limits: dict[str, str] = field(default_factory=dict)


def settings_of(config: Config) -> MpsSettings:
    return MpsSettings(
        root=config.mps_root,
        binary=driver.binary(str(config.driver_root), config.mps_control),
        exclusive_process=config.mps_exclusive_process,
        shm_size=config.mps_shm_size,
        probe_seconds=config.mps_probe_seconds,
        library_path=driver.library_dir(str(config.driver_root)),
    )


class MpsSupervisor:
    def __init__(
        self,
        *,
        settings: MpsSettings,
        health: Health,
        metrics: DaemonMetrics,
        backend: GpuBackend,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.health = health
        self.metrics = metrics
        self.backend = backend
        self.clock = clock
        self._lock = threading.Lock()
        self._daemons: dict[str, GpuDaemon] = {}
        self._multiuser: bool | None = None

    # --- the GPUs to serve, from the service loop -------------------------------------------------------

    def sync(self, gpus: Sequence[GpuDevice]) -> None:
        with self._lock:
            for gpu in gpus:
                if gpu.uuid not in self._daemons:
                    control = self.settings.control(gpu.uuid, timeout=max(2.0, self.settings.probe_seconds))
                    self._daemons[gpu.uuid] = GpuDaemon(gpu=gpu, control=control)
                    # Unusable until its daemon answers: no MPS pod may be admitted onto it before.
                    self.health.condition(gpu.uuid, "MPS control daemon starting")
                else:
                    self._daemons[gpu.uuid].gpu = gpu

    def run(self, stop: threading.Event) -> None:
        """The supervision loop (its own thread): probe every daemon, start or restart where needed."""
        while not stop.is_set():
            self.check()
            stop.wait(self.settings.probe_seconds)

    def check(self) -> None:
        with self._lock:
            daemons = list(self._daemons.values())
        for daemon in daemons:
            try:
                self._check(daemon)
            except Exception:  # one GPU's trouble must not stop the supervision of the others
                log.exception("MPS supervision of GPU %d failed", daemon.gpu.index)

    def _check(self, daemon: GpuDaemon) -> None:
        gpu, control = daemon.gpu, daemon.control
        if control.dirs.stopped.exists():
            if daemon.state != "stopped":
                log.warning("MPS on GPU %d stopped by an operator (gpushared mps start resumes it)", gpu.index)
            # A restart decided just before the operator's stop can start a daemon just after it: the
            # operator's word holds, so a daemon found running now is stopped too.
            if control.pid() is not None:
                pid = shut_down(control, settings=self.settings, backend=self.backend)
                log.warning("MPS on GPU %d: quit control daemon %s, started as MPS was stopped", gpu.index, pid)
            self._set(daemon, "stopped", "MPS stopped by `gpushared mps stop`", pid=None)
            return
        if daemon.pid is None and daemon.state == "starting":
            pid = control.pid()
            if pid is not None and self._answers(daemon):
                daemon.adopted = True
                self._read_limits(daemon)
                self._set(daemon, "running", None, pid=pid)
                log.info("MPS on GPU %d: adopted the running control daemon %d", gpu.index, pid)
                return
            if pid is not None:
                if daemon.adopt_until is None:
                    daemon.adopt_until = self.clock() + ADOPT_GRACE_SECONDS
                if self.clock() < daemon.adopt_until:
                    log.warning(
                        "MPS on GPU %d: the running control daemon %d does not answer yet (%s); asking again",
                        gpu.index,
                        pid,
                        daemon.problem,
                    )
                    return
        if daemon.state == "running":
            if self._answers(daemon):
                if self.clock() - daemon.since >= MAX_BACKOFF:
                    daemon.backoff = 1.0  # stable again: the next failure restarts it quickly
                return
            log.error(
                "MPS control daemon %s of GPU %d stopped answering (%s); restart in %.0f s",
                daemon.pid,
                gpu.index,
                daemon.problem,
                daemon.backoff,
            )
            self._set(daemon, "failed", f"MPS control daemon not answering: {daemon.problem}", pid=daemon.pid)
            self._back_off(daemon)
            return
        if self.clock() >= daemon.next_start:
            self._restart(daemon)

    def _back_off(self, daemon: GpuDaemon) -> None:
        daemon.next_start = self.clock() + daemon.backoff
        daemon.backoff = min(daemon.backoff * 2, MAX_BACKOFF)

    def _answers(self, daemon: GpuDaemon) -> bool:
        try:
            daemon.control.command("get_default_active_thread_percentage")
        except MpsError as exc:
            daemon.problem = str(exc)
            return False
        return True

    def _restart(self, daemon: GpuDaemon) -> None:
        gpu, control = daemon.gpu, daemon.control
        first = daemon.state in ("starting", "stopped")  # not a restart after a failure
        old = daemon.pid if daemon.pid is not None else control.pid()
        if old is not None:
            control.kill(old)  # alive but hung: it serves nobody, and it holds the control socket
        try:
            if self.settings.exclusive_process:
                self.backend.set_exclusive_process(gpu.uuid, True)
            if self._multiuser is None:
                self._multiuser = control.supports_multiuser()
            pid = control.start(shm_size=self.settings.shm_size, multiuser=self._multiuser)
            control.command("set_default_active_thread_percentage 100")
            self._set_memory_ceiling(daemon)
        except (MpsError, GpuBackendError, OSError) as exc:
            log.error("MPS on GPU %d: start failed (%s); next try in %.0f s", gpu.index, exc, daemon.backoff)
            self._set(daemon, "failed", f"MPS control daemon failed to start: {exc}", pid=None)
            self._back_off(daemon)
            return
        if not first:
            daemon.restarts += 1
            self.metrics.mps_restarts.labels(**self.metrics.gpu_labels(gpu)).inc()
        daemon.adopted = False
        self._read_limits(daemon)
        self._set(daemon, "running", None, pid=pid)
        log.info("MPS on GPU %d: control daemon %d started (%s)", gpu.index, pid, ", ".join(daemon.limits.values()))

    def _set_memory_ceiling(self, daemon: GpuDaemon) -> None:
        """The whole GPU as the default pinned-memory limit, by UUID; by ordinal 0 when the daemon cannot
        resolve the UUID (it sees its one GPU as device 0 either way, through CUDA_VISIBLE_DEVICES)."""
        control, limit = daemon.control, f"{daemon.gpu.memory_mib}M"
        for device in (daemon.gpu.uuid, "0"):
            control.command(f"set_default_device_pinned_mem_limit {device} {limit}")
            if _is_limit(control.command(f"get_default_device_pinned_mem_limit {device}")):
                return
        raise MpsError("the daemon did not keep the default pinned memory limit")

    def _read_limits(self, daemon: GpuDaemon) -> None:
        control = daemon.control
        limits = {"threads": control.command("get_default_active_thread_percentage")}
        for device in (daemon.gpu.uuid, "0"):
            answer = control.command(f"get_default_device_pinned_mem_limit {device}")
            if _is_limit(answer):
                limits["memory"] = answer
                break
        daemon.limits = limits

    def _set(self, daemon: GpuDaemon, state: str, problem: str | None, *, pid: int | None) -> None:
        if state == "running" and daemon.state != "running":
            daemon.since = self.clock()
        daemon.state, daemon.pid = state, pid
        if problem is not None:
            daemon.problem = problem
        elif state == "running":
            daemon.problem = None
        self.health.condition(daemon.gpu.uuid, problem)
        self.metrics.mps_up.labels(**self.metrics.gpu_labels(daemon.gpu)).set(1 if state == "running" else 0)

    # --- Allocate --------------------------------------------------------------------------------------------

    def running(self, uuid: str) -> bool:
        with self._lock:
            daemon = self._daemons.get(uuid)
            return daemon is not None and daemon.state == "running"

    def answering(self) -> dict[str, MpsDaemon]:
        """The running daemons by GPU UUID, with the directories a client container mounts
        (``core.node.allocate`` makes the container their client)."""
        with self._lock:
            uuids = [uuid for uuid, daemon in self._daemons.items() if daemon.state == "running"]
        answering = {}
        for uuid in uuids:
            dirs = GpuDirs.of(self.settings.root, uuid)
            answering[uuid] = MpsDaemon(pipe=str(dirs.pipe), shm=str(dirs.shm))
        return answering

    # --- status --------------------------------------------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            daemons = sorted(self._daemons.values(), key=lambda d: d.gpu.index)
        rows = []
        for daemon in daemons:
            clients: int | None = None
            if daemon.state == "running":
                try:
                    clients = sum(len(daemon.control.clients(s)) for s in daemon.control.servers())
                except MpsError:
                    clients = None
            rows.append(
                {
                    "gpu": daemon.gpu.index,
                    "uuid": daemon.gpu.uuid,
                    "pid": daemon.pid,
                    "state": daemon.state,
                    "adopted": daemon.adopted,
                    "restarts": daemon.restarts,
                    "clients": clients,
                    "limits": dict(daemon.limits),
                    "problem": daemon.problem,
                    "pipe": str(daemon.control.dirs.pipe),
                }
            )
        return rows


def _is_limit(answer: str) -> bool:
    """Whether a get_default_device_pinned_mem_limit answer is a limit ("16G", "8192M"), not "No ... set"."""
    return bool(answer) and answer[0].isdigit()


# --- operator commands (gpushared mps stop | start) ---------------------------------------------------------


def daemon_uuids(settings: MpsSettings, *, gpu: str | None, backend: GpuBackend) -> list[str]:
    """The GPUs with a daemon directory, all or the one named by UUID or NVML index."""
    root = Path(settings.root)
    known = sorted(p.name for p in root.iterdir() if (p / "pipe").is_dir()) if root.is_dir() else []
    if gpu is None or gpu in known:
        return known if gpu is None else [gpu]
    if gpu.isdigit():
        backend.start()
        for device in backend.devices()[0]:
            if device.index == int(gpu) and device.uuid in known:
                return [device.uuid]
    raise MpsError(f"no MPS daemon directory for GPU {gpu} under {root}")


def stop_daemon(settings: MpsSettings, uuid: str, *, backend: GpuBackend) -> str:
    """Quit one GPU's daemon on purpose; a running gpushared leaves it stopped until `gpushared mps start`."""
    control = settings.control(uuid)
    control.dirs.stopped.touch()  # first, so that the supervisor does not start it again meanwhile
    pid = shut_down(control, settings=settings, backend=backend)
    return f"GPU {uuid}: " + (f"MPS control daemon {pid} stopped" if pid else "no MPS control daemon was running")


def shut_down(control: MpsControl, *, settings: MpsSettings, backend: GpuBackend) -> int | None:
    """Quit the daemon if one runs, release its shm and give the GPU back its default compute mode; the
    pid that was quit. The supervisor may be restarting the same daemon meanwhile (it probes, the operator
    stops): a daemon gone by the time it is told to quit is as good as quit."""
    pid = control.pid()
    for attempt in range(QUIT_ATTEMPTS if pid is not None else 0):
        try:
            control.quit()
            break
        except MpsError:
            if control.pid() is None:
                break
            if attempt == QUIT_ATTEMPTS - 1:
                raise
            # The control daemon serves one client at a time: the supervisor's probe may hold it just now.
            time.sleep(0.2)
    control.release_shm()
    if settings.exclusive_process:
        backend.start()
        backend.set_exclusive_process(control.uuid, False)
    return pid


def prepare_mounts(settings: MpsSettings, *, backend: GpuBackend) -> list[str]:
    """Every GPU's directories and shm tmpfs, mounted from the host's namespace; one line per GPU."""
    backend.start()
    host = host_mount_namespace()
    lines = []
    for gpu in backend.devices()[0]:
        if gpu.mig_enabled:
            continue  # never advertised, so never given an MPS daemon
        control = settings.control(gpu.uuid)
        mounted = control.prepare(shm_size=settings.shm_size, host=host)
        lines.append(
            f"GPU {gpu.index} ({gpu.uuid}): {control.dirs.shm} " + ("mounted" if mounted else "already mounted")
        )
    return lines


def resume_daemon(settings: MpsSettings, uuid: str) -> str:
    GpuDirs.of(settings.root, uuid).stopped.unlink(missing_ok=True)
    return f"GPU {uuid}: a running gpushared starts its MPS control daemon within {settings.probe_seconds:.0f} s"


#: CAP_SYS_ADMIN's bit in /proc's capability masks (linux/capability.h).
_CAP_SYS_ADMIN = 21
#: Where the package puts the unit's MPS drop-in.
MPS_DROP_IN = "/usr/share/gpushared/mps.conf"


def missing_mps_privilege(status: Path = Path("/proc/self/status")) -> str | None:
    """Why this process cannot run MPS daemons (it needs CAP_SYS_ADMIN for their mount namespace and
    tmpfs), with what to do; None when it can. The unit grants it only with its MPS drop-in."""
    try:
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        effective = int(fields["CapEff"].strip(), 16)
    except (OSError, KeyError, ValueError):
        return None  # cannot tell: let the mounts themselves say
    if effective >> _CAP_SYS_ADMIN & 1:
        return None
    return (
        "mps.enabled is set, but gpushared runs without CAP_SYS_ADMIN, which MPS needs: install the unit's MPS "
        f"drop-in (install -D -m 0644 {MPS_DROP_IN} /etc/systemd/system/gpushared.service.d/mps.conf; "
        "systemctl daemon-reload; systemctl restart gpushared), or turn MPS off"
    )
