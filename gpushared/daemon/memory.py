"""The memory watcher: every GPU's processes, attributed to their containers, and acted on (core.node.memory).

Each poll reads every GPU's running processes from NVML (host PIDs, with the memory each holds there),
pins each process with a pidfd, reads its ``/proc/<pid>/cgroup`` to find its pod and container
(``core.node.cgroups``), and hands the lot to ``core.node.memory.decide_memory``. A PID that exited between NVML's
list and our read has no cgroup to read and is left out of this poll (its memory is being freed; NVML stops
listing it). A PID that was reused in that window is a different process: the pidfd was opened before the
cgroup was read, so the cgroup read is the pinned process's own, and a signal through the pidfd can only
reach that process — never one that took its PID later. Where the kernel or the unit's seccomp filter has
no pidfds, the cgroup is read again just before a kill, and a process that is no longer the container's
is spared.

Events go through the outbox (never on the poll's thread), and the series go to the metrics' container
collector, read at scrape time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpushared.contract import MemoryUnit, ResourceNames
from gpushared.core.dra.allowances import claim_allowances, combination_problem
from gpushared.core.dra.claimusers import ClaimUse, claim_users
from gpushared.core.dra.prepare import PreparedClaim
from gpushared.core.node.cgroups import CgroupOwner, owner_of
from gpushared.core.node.memory import (
    Allowance,
    ContainerUsage,
    Enforcement,
    Episode,
    EpisodeKey,
    GpuProcess,
    Kill,
    MemoryDecision,
    MemoryPolicy,
    Report,
    allowances_of,
    decide_memory,
    enforcement_problem,
    given_by_kubelet,
    owner_ref,
)
from gpushared.core.shared.bodies import PodBody, key_of, meta_of, qualified_name, uid_of
from gpushared.daemon.compute import ComputeWatcher
from gpushared.daemon.metrics import ContainerMemory, DaemonMetrics
from gpushared.daemon.outbox import Outbox
from gpushared.kubelet.podresources.client import PodDevices, PodResourcesUnavailable
from gpushared.nvml.backend import GpuBackend, GpuBackendError, NvmlProcess

log = logging.getLogger(__name__)

EVENT_OVER_LIMIT = "GPUMemoryOverLimit"
EVENT_BAD_ANNOTATION = "GPUMemoryEnforcementInvalid"
EVENT_COMBINATION = "DRAClaimsCombinedOtherwise"
MIB = 2**20


@dataclass(frozen=True)
class Pinned:
    """A process as one poll saw it: its pidfd (None where pidfds are not to be had) and cgroup owner."""

    pid: int
    fd: int | None
    owner: CgroupOwner | None


class ProcessTable:
    """``/proc`` read for one poll: each PID pinned before its cgroup is read; the pidfds closed after."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._pinned: dict[int, Pinned | None] = {}

    def pin(self, pid: int) -> Pinned | None:
        """The process, or None when it has exited."""
        if pid in self._pinned:
            return self._pinned[pid]
        fd: int | None = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pinned[pid] = None
            return None
        except OSError:  # no pidfds here (an old kernel, a seccomp filter): re-checked before any kill
            fd = None
        try:
            owner = owner_of((self.proc / str(pid) / "cgroup").read_text())
        except (FileNotFoundError, ProcessLookupError):
            if fd is not None:
                os.close(fd)
            self._pinned[pid] = None
            return None
        pinned = self._pinned[pid] = Pinned(pid, fd, owner)
        return pinned

    def kill(self, pinned: Pinned) -> bool:
        """SIGKILL the pinned process; False when it is gone, or no longer the process that was read."""
        try:
            if pinned.fd is not None:
                signal.pidfd_send_signal(pinned.fd, signal.SIGKILL)
                return True
            now = owner_of((self.proc / str(pinned.pid) / "cgroup").read_text())
            if now != pinned.owner:
                return False
            os.kill(pinned.pid, signal.SIGKILL)
            return True
        except (ProcessLookupError, FileNotFoundError):
            return False

    def close(self) -> None:
        for pinned in self._pinned.values():
            if pinned is not None and pinned.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(pinned.fd)
        self._pinned.clear()


@contextlib.contextmanager
def process_table(proc: Path) -> Iterator[ProcessTable]:
    table = ProcessTable(proc)
    try:
        yield table
    finally:
        table.close()


@dataclass(frozen=True)
class GpuView:
    index: int
    uuid: str
    memory_mib: int


#: what a poll read of the pods: ((the pods' version, GPU indices), pods by UID, their containers' allowances)
_Read = tuple[tuple[int, tuple[int, ...], int], dict[str, "PodBody"], dict[tuple[str, str], "Allowance"]]


#: What a pod's allowances were worked out from beside its resourceVersion: the GPUs' indices, the prepared
#: claims' version and the containers that use each claim on the node.
Basis = tuple[tuple[int, ...], int, frozenset[tuple[ClaimUse, int]]]


@dataclass(frozen=True)
class ClaimsView:
    """The DRA claims prepared on the node, by namespace and name, and a count that changes with them."""

    claims: Callable[[], Mapping[tuple[str, str], PreparedClaim]]
    version: Callable[[], int]


class MemoryWatcher:
    def __init__(
        self,
        *,
        backend: GpuBackend,
        gpus: Callable[[], list[GpuView]],
        pods: Callable[[], list[PodBody]],
        outbox: Outbox,
        metrics: DaemonMetrics,
        unit: MemoryUnit,
        resources: ResourceNames,
        enforcement: Enforcement,
        policy: MemoryPolicy,
        poll_seconds: float = 2.0,
        pod_devices: Callable[[], Sequence[PodDevices]] | None = None,
        pods_version: Callable[[], int] | None = None,
        proc: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
        compute: ComputeWatcher | None = None,
        claims: ClaimsView | None = None,
    ) -> None:
        """``pods_version``: a count that changes whenever ``pods()`` would answer differently (the pod
        mirror's changes); while it stands, a poll reuses the pods and allowances of the last one.
        ``compute``: given the processes each poll found and their containers, to watch their SM use.
        ``claims``: in DRA mode, the claims prepared on the node, which give their pods' containers theirs."""
        self.backend = backend
        self.gpus = gpus
        self.pods = pods
        self.outbox = outbox
        self.metrics = metrics
        self.unit = unit
        self.resources = resources
        self.enforcement = enforcement
        self.policy = policy
        self.poll_seconds = poll_seconds
        #: the kubelet's PodResources listing: what each container was given (None: annotations alone)
        self.pod_devices = pod_devices
        self.pods_version = pods_version
        #: (pods' version, GPU indices) -> the pods by UID and their containers' allowances, as last read
        self._read: _Read | None = None
        self._listing_failed = False
        self.proc = proc
        self.clock = clock
        self.compute = compute
        self.claims = claims
        self.last = MemoryDecision()
        self._uuids: dict[int, str] = {}
        self._episodes: dict[EpisodeKey, Episode] = {}
        self._unreadable: set[str] = set()  # GPUs whose processes NVML would not list, logged once
        #: pod UID -> (resourceVersion, (GPU indices, claims' version, claims' users), its containers' allowances)
        self._known: dict[str, tuple[str, Basis, dict[tuple[str, str], Allowance]]] = {}
        metrics.watch_containers(self.series)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.poll_seconds):
            try:
                self.poll()
            except Exception:  # one bad poll must not end the watching
                log.exception("GPU memory poll failed")

    def poll(self) -> MemoryDecision:
        started = time.perf_counter()
        gpus = self.gpus()
        pods, allowances = self._pods_and_allowances(gpus)
        listed = {gpu.index: self._processes(gpu) for gpu in gpus}
        if any(listed.values()):  # the kubelet's PodResources list is asked only when there is use to attribute
            allowances = {**allowances, **self._given(pods, allowances)}
        with process_table(self.proc) as table:
            processes = []
            pinned: dict[int, Pinned] = {}
            for gpu in gpus:
                for process in listed[gpu.index]:
                    found = table.pin(process.pid)
                    if found is None:
                        continue  # exited since NVML listed it
                    pinned[process.pid] = found
                    owner = owner_ref(found.owner, pods)
                    processes.append(GpuProcess(process.pid, gpu.index, process.used_mib or 0, owner))
            decision = decide_memory(
                processes,
                allowances,
                gpu_mib={gpu.index: gpu.memory_mib for gpu in gpus},
                policy=self.policy,
                episodes=self._episodes,
                now=self.clock(),
            )
            done = {kill.pid for kill in decision.kills if table.kill(pinned[kill.pid])}
        self._episodes = decision.episodes
        self._uuids = {gpu.index: gpu.uuid for gpu in gpus}
        if self.compute is not None:
            self.compute.observe(self._uuids, processes, pods)
        self.last = decision
        self._tell(decision, pods, done)
        self.metrics.usage_polls.observe(time.perf_counter() - started)
        return decision

    def _pods_and_allowances(self, gpus: list[GpuView]) -> tuple[dict[str, PodBody], dict[tuple[str, str], Allowance]]:
        """The node's pods by UID and their containers' allowances; read again only when the pod mirror or the
        GPUs changed since the last poll (an idle node's poll was mostly this: 400 pods walked every 2 s)."""
        indices = tuple(gpu.index for gpu in gpus)
        claims = self.claims.version() if self.claims is not None else 0
        version = (self.pods_version(), indices, claims) if self.pods_version is not None else None
        if version is not None and self._read is not None and self._read[0] == version:
            return self._read[1], self._read[2]
        pods = {uid_of(pod): pod for pod in self.pods()}
        allowances = self._allowances(pods, gpus)
        if version is not None:
            self._read = (version, pods, allowances)
        return pods, allowances

    def _allowances(self, pods: Mapping[str, PodBody], gpus: list[GpuView]) -> dict[tuple[str, str], Allowance]:
        """Every container's allowance, each pod's worked out again only when its resourceVersion (or the
        node's GPUs) changed: parsing 400 pods' records took half of a poll."""
        indices = tuple(gpu.index for gpu in gpus)
        prepared = self.claims.claims() if self.claims is not None else {}
        # the containers sharing each claim, over every pod here: a pod that joins a claim shrinks the
        # others' parts (core.dra.claimusers)
        users = claim_users(pods.values()) if prepared else Counter()
        # a claim prepared or gone, or its users changed, changes its pods' allowances without a new
        # resourceVersion
        basis = (indices, self.claims.version() if self.claims is not None else 0, frozenset(users.items()))
        allowances: dict[tuple[str, str], Allowance] = {}
        kept: dict[str, tuple[str, Basis, dict[tuple[str, str], Allowance]]] = {}
        for uid, pod in pods.items():
            version = meta_of(pod).get("resourceVersion") or ""
            known = self._known.get(uid)
            if version and known is not None and known[:2] == (version, basis):
                found = known[2]
            else:
                found = allowances_of(
                    pod, unit=self.unit, resources=self.resources, node=self.enforcement, gpus=list(indices)
                )
                if prepared:
                    found.update(claim_allowances(pod, prepared, node=self.enforcement, users=users))
                problem = enforcement_problem(pod, self.enforcement)
                if problem is not None and (known is None or known[0] != version):
                    log.warning("pod %s: %s", qualified_name(pod), problem)
                    self.outbox.event(pod, EVENT_BAD_ANNOTATION, problem, warning=True)
                combined = combination_problem(pod, prepared) if prepared else None
                if combined is not None and (known is None or known[0] != version):
                    # a pod the driver never saw (docs/dra.md, "What the container gets"): said, not silent
                    message = f"its containers may be told other GPUs than their claims hold: {combined}"
                    log.warning("pod %s: %s", qualified_name(pod), message)
                    self.outbox.event(pod, EVENT_COMBINATION, message, warning=True)
            kept[uid] = (version, basis, found)
            allowances.update(found)
        self._known = kept
        return allowances

    def _given(
        self, pods: Mapping[str, PodBody], allowances: Mapping[tuple[str, str], Allowance]
    ) -> dict[tuple[str, str], Allowance]:
        """What the kubelet gave each listed container, in place of what the annotations say."""
        if self.pod_devices is None:
            return {}
        try:
            listing = self.pod_devices()
        except PodResourcesUnavailable as exc:
            if not self._listing_failed:
                log.warning("kubelet PodResources unavailable (%s): allowances from the pods' annotations", exc)
            self._listing_failed = True
            return {}
        self._listing_failed = False
        uids = {key_of(pod): uid for uid, pod in pods.items()}
        given: dict[tuple[str, str], Allowance] = {}
        for entry in listing:
            uid = uids.get((entry.namespace, entry.name))
            if uid is not None:
                given.update(given_by_kubelet(allowances, uid, entry.containers, unit=self.unit))
        return given

    def _processes(self, gpu: GpuView) -> list[NvmlProcess]:
        try:
            listed = self.backend.processes(gpu.uuid)
        except GpuBackendError as exc:
            if gpu.uuid not in self._unreadable:
                self._unreadable.add(gpu.uuid)
                log.warning("GPU %d: its processes cannot be read (%s); its memory is not watched", gpu.index, exc)
            return []
        self._unreadable.discard(gpu.uuid)
        return listed

    def _tell(self, decision: MemoryDecision, pods: Mapping[str, PodBody], done: set[int]) -> None:
        tolerance = self.policy.tolerance_mib
        for report in decision.reports:
            self.metrics.overruns.inc()
            pod = pods.get(report.usage.ref.uid)
            message = _report_message(report, tolerance, self._uuids.get(report.usage.gpu, ""))
            log.warning("%s", message)
            if pod is not None:
                self.outbox.event(pod, EVENT_OVER_LIMIT, message, warning=True)
        for kill in decision.kills:
            if kill.pid not in done:
                log.info("process %d of %s was gone before it could be killed", kill.pid, kill.usage.ref)
                continue
            self.metrics.overrun_kills.labels(reason=kill.reason).inc()
            pod = pods.get(kill.usage.ref.uid)
            message = _kill_message(kill, tolerance, self._uuids.get(kill.usage.gpu, ""))
            log.warning("%s", message)
            if pod is not None:
                self.outbox.event(pod, EVENT_OVER_LIMIT, message, warning=True)

    def series(self) -> list[ContainerMemory]:
        return [
            ContainerMemory(
                namespace=usage.ref.namespace,
                pod=usage.ref.pod,
                container=usage.ref.container,
                gpu=usage.gpu,
                uuid=self._uuids.get(usage.gpu, ""),
                used_bytes=usage.used_mib * MIB,
                allocated_bytes=usage.allocated_mib * MIB,
            )
            for usage in self.last.usages
        ]

    def gpu_usage(self) -> dict[int, int] | None:
        """MiB each GPU's processes used at the last poll, pods' and others'; None before the first."""
        if not self._uuids:
            return None
        used = dict.fromkeys(self._uuids, 0)
        for usage in self.last.usages:
            used[usage.gpu] = used.get(usage.gpu, 0) + usage.used_mib
        for gpu, processes in self.last.host.items():
            used[gpu] = used.get(gpu, 0) + sum(mib for _, mib in processes)
        return used

    def status(self) -> dict[str, Any]:
        """For ``/status`` and ``gpushared status``."""
        return {
            "containers": [
                {
                    "namespace": usage.ref.namespace,
                    "pod": usage.ref.pod,
                    "container": usage.ref.container,
                    "gpu": usage.gpu,
                    "usedMiB": usage.used_mib,
                    "allocatedMiB": usage.allocated_mib,
                    "pids": list(usage.pids),
                }
                for usage in self.last.usages
            ],
            "hostProcesses": {
                str(gpu): [{"pid": pid, "usedMiB": mib} for pid, mib in processes]
                for gpu, processes in sorted(self.last.host.items())
            },
            "enforcement": str(self.enforcement),
        }


def _over(usage: ContainerUsage, tolerance: int, uuid: str) -> str:
    return (
        f"container {usage.ref.container!r} uses {usage.used_mib} MiB of GPU {usage.gpu} ({uuid}), "
        f"allocated {usage.allocated_mib} MiB (+{tolerance} MiB tolerance)"
    )


def _report_message(report: Report, tolerance: int, uuid: str) -> str:
    then = {
        Enforcement.REPORT: "reported only (memory enforcement: report)",
        Enforcement.KILL: "its largest processes there are killed if it stays over (memory enforcement: kill)",
        Enforcement.OFF: "",
    }[report.enforcement]
    return f"{_over(report.usage, tolerance, uuid)}; {then}"


def _kill_message(kill: Kill, tolerance: int, uuid: str) -> str:
    why = (
        "still over after the grace period (memory enforcement: kill)"
        if kill.reason == "kill"
        else "the GPU is nearly full and this container is the most over its allocation"
    )
    return f"{_over(kill.usage, tolerance, uuid)}: killed process {kill.pid} ({kill.used_mib} MiB), {why}"
