"""What the daemon does about containers that use more GPU memory than their pods asked for.

The daemon polls NVML for every GPU's processes and their memory, and attributes each process to its pod and
container (``core.node.cgroups``). This module decides, from one such reading, what each container uses beside
what it was allocated, and what to do: per pod, the node's enforcement (config ``memoryEnforcement``) made
stricter, never looser, by the pod's ``gpushared.io/memory-enforcement`` annotation:

- ``off``: nothing.
- ``report`` (the default): a ``GPUMemoryOverLimit`` Event once per episode, an episode being the time a
  container stays over its allocation plus ``memoryToleranceMiB`` (the CUDA context, which no pod asks for).
- ``kill``: a container still over after ``memoryGraceSeconds`` loses processes, the largest first, until
  what is left of it is within; the kubelet restarts the container by its restartPolicy.

**Protecting the neighbours.** When a GPU's used memory, all processes counted, passes its size less
``memoryReserveMiB``, the pods within their allocations are about to fail to allocate what they asked for.
Then containers over their allocation (plus tolerance) on that GPU lose processes at once, without the
grace, most over first, until the GPU is back under that line or no container is over — under ``report``
too; under ``off``, never.

Never killed: a process of a container within its allocation plus tolerance, a process of no pod (host
jobs, the MPS server), a process of an MPS pod (its MPS limit holds it; it is reported only). Pure: the
caller passes the time and the episodes it kept from the last decision.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpushared import contract
from gpushared.contract import ContractError, MemoryUnit, ResourceNames
from gpushared.core.node.cgroups import CgroupOwner, container_id_of
from gpushared.core.node.devices import gpu_of
from gpushared.core.node.handshake import slots_of
from gpushared.core.shared.bodies import PodBody, annotations_of, key_of, uid_of
from gpushared.core.shared.requests import pod_request


class Enforcement(enum.IntEnum):
    """Ordered by strictness: a pod's annotation may raise its node's, never lower it."""

    OFF = 0
    REPORT = 1
    KILL = 2

    @classmethod
    def parse(cls, text: str, *, key: str = contract.POD_MEMORY_ENFORCEMENT) -> Enforcement:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise contract.ContractError(key=key, value=text, reason="must be one of off, report, kill") from None

    def __str__(self) -> str:
        return self.name.lower()


def pod_enforcement(node: Enforcement, annotation: str | None) -> Enforcement:
    """The pod's enforcement: the node's, or the annotation's where that is stricter. A malformed annotation
    is the node's (``enforcement_problem`` says why, for an Event on the pod)."""
    if annotation is None:
        return node
    try:
        return max(node, Enforcement.parse(annotation))
    except contract.ContractError:
        return node


@dataclass(frozen=True)
class ContainerRef:
    uid: str
    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod} container {self.container!r}"


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu: int
    used_mib: int
    #: the container it runs in; None for a process of no pod's container
    owner: ContainerRef | None


@dataclass(frozen=True)
class Allowance:
    """What one container may use on each GPU, and how its pod wants that enforced."""

    allocated_mib: Mapping[int, int]
    enforcement: Enforcement
    mps: bool = False


@dataclass(frozen=True)
class MemoryPolicy:
    grace_seconds: float = 10.0
    tolerance_mib: int = 256
    reserve_mib: int = 0


@dataclass
class Episode:
    """A container over its allocation on one GPU, since ``since``."""

    since: float
    reported: bool = False


EpisodeKey = tuple[str, str, int]  # (pod UID, container, GPU index)


@dataclass(frozen=True)
class ContainerUsage:
    ref: ContainerRef
    gpu: int
    used_mib: int
    allocated_mib: int
    pids: tuple[int, ...]

    def over_mib(self, tolerance_mib: int) -> int:
        """MiB past its allocation and the tolerance; 0 or less when within."""
        return self.used_mib - self.allocated_mib - tolerance_mib


@dataclass(frozen=True)
class Report:
    usage: ContainerUsage
    enforcement: Enforcement


@dataclass(frozen=True)
class Kill:
    pid: int
    used_mib: int
    usage: ContainerUsage
    #: why: "kill" (past the grace) or "pressure" (the GPU's reserve was reached)
    reason: str


@dataclass
class MemoryDecision:
    usages: list[ContainerUsage] = field(default_factory=list)
    #: processes of no pod's container, per GPU: (pid, MiB)
    host: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    reports: list[Report] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    episodes: dict[EpisodeKey, Episode] = field(default_factory=dict)


def decide_memory(
    processes: Iterable[GpuProcess],
    allowances: Mapping[tuple[str, str], Allowance],
    *,
    gpu_mib: Mapping[int, int],
    policy: MemoryPolicy,
    episodes: Mapping[EpisodeKey, Episode],
    now: float,
) -> MemoryDecision:
    """One poll's usage per container and what to do about it.

    ``allowances`` is keyed by (pod UID, container name); a container with a process on a GPU but no
    allowance there (a pod that asked for no GPU memory and reached a GPU anyway) is allocated 0 there, under
    the node's enforcement as its allowance says, or ``report`` when it has none. ``gpu_mib`` is each GPU's
    size; ``episodes`` what the last decision returned.
    """
    decision = MemoryDecision()
    grouped: dict[tuple[ContainerRef, int], list[GpuProcess]] = defaultdict(list)
    total: dict[int, int] = defaultdict(int)
    for process in processes:
        total[process.gpu] += process.used_mib
        if process.owner is None:
            decision.host.setdefault(process.gpu, []).append((process.pid, process.used_mib))
        else:
            grouped[(process.owner, process.gpu)].append(process)
    for (ref, gpu), owned in sorted(grouped.items(), key=lambda item: (item[0][1], str(item[0][0]))):
        allowance = allowances.get((ref.uid, ref.container))
        allocated = allowance.allocated_mib.get(gpu, 0) if allowance is not None else 0
        owned.sort(key=lambda p: (-p.used_mib, p.pid))
        usage = ContainerUsage(ref, gpu, sum(p.used_mib for p in owned), allocated, tuple(p.pid for p in owned))
        decision.usages.append(usage)
    #: pid -> GPU -> MiB: a process on several GPUs frees each when it is killed
    held: dict[int, dict[int, int]] = defaultdict(dict)
    for owned in grouped.values():
        for process in owned:
            held[process.pid][process.gpu] = process.used_mib
    killed: set[int] = set()

    def kill(pid: int, usage: ContainerUsage, reason: str) -> None:
        decision.kills.append(Kill(pid, held[pid][usage.gpu], usage, reason))
        killed.add(pid)
        for gpu, mib in held[pid].items():
            total[gpu] -= mib

    for usage in decision.usages:
        allowance = allowances.get((usage.ref.uid, usage.ref.container))
        enforcement = allowance.enforcement if allowance is not None else Enforcement.REPORT
        key = (usage.ref.uid, usage.ref.container, usage.gpu)
        if usage.over_mib(policy.tolerance_mib) <= 0 or enforcement is Enforcement.OFF:
            continue  # within, or not watched: its episode, if any, ends
        known = episodes.get(key)
        episode = Episode(since=known.since, reported=known.reported) if known is not None else Episode(since=now)
        if not episode.reported:
            decision.reports.append(Report(usage, enforcement))
            episode.reported = True
        decision.episodes[key] = episode
        mps = allowance is not None and allowance.mps
        if enforcement is Enforcement.KILL and not mps and now - episode.since >= policy.grace_seconds:
            for pid in _to_kill(usage, held, policy.tolerance_mib, killed):
                kill(pid, usage, "kill")
    for gpu in sorted(total):
        line = gpu_mib.get(gpu, 0) - policy.reserve_mib
        pressed = sorted(
            (
                u
                for u in decision.usages
                if u.gpu == gpu and u.over_mib(policy.tolerance_mib) > 0 and _pressable(u, allowances)
            ),
            key=lambda u: (-u.over_mib(policy.tolerance_mib), str(u.ref)),
        )
        for usage in pressed:
            if total[gpu] <= line:
                break
            for pid in _to_kill(usage, held, policy.tolerance_mib, killed):
                kill(pid, usage, "pressure")
    return decision


def _pressable(usage: ContainerUsage, allowances: Mapping[tuple[str, str], Allowance]) -> bool:
    allowance = allowances.get((usage.ref.uid, usage.ref.container))
    if allowance is None:
        return True  # a pod that asked for no GPU memory, under the default report
    return allowance.enforcement is not Enforcement.OFF and not allowance.mps


def _to_kill(
    usage: ContainerUsage, held: Mapping[int, Mapping[int, int]], tolerance_mib: int, killed: set[int]
) -> Sequence[int]:
    """The container's processes on the GPU to kill, largest first, until what is left of it there is within
    its allocation plus the tolerance."""
    left = usage.used_mib - sum(held[pid][usage.gpu] for pid in usage.pids if pid in killed)
    chosen = []
    for pid in usage.pids:  # largest first
        if left - usage.allocated_mib - tolerance_mib <= 0:
            break
        if pid in killed or not held[pid][usage.gpu]:
            continue  # gone already, or frees nothing here
        chosen.append(pid)
        left -= held[pid][usage.gpu]
    return chosen


def enforcement_problem(pod: PodBody, node: Enforcement) -> str | None:
    """Why the pod's ``gpushared.io/memory-enforcement`` is not taken, or None."""
    text = annotations_of(pod).get(contract.POD_MEMORY_ENFORCEMENT)
    if text is None:
        return None
    try:
        Enforcement.parse(text)
    except contract.ContractError as exc:
        return f"{exc}; the node's {node} applies"
    return None


def allowances_of(
    pod: PodBody, *, unit: MemoryUnit, resources: ResourceNames, node: Enforcement, gpus: Sequence[int]
) -> dict[tuple[str, str], Allowance]:
    """What each container of ``pod`` may use on each GPU, keyed by (pod UID, container name).

    From the pod's recorded GPU choice (``core.node.handshake.slots_of``: our allocation annotation, or Aliyun's
    index): a container's share on each of its GPUs. A container that asks for no GPU memory may use none.
    Where the choice cannot be read, each container may use what it asks for on any of the node's ``gpus``:
    the daemon never acts on a pod by a record it cannot read."""
    uid = uid_of(pod)
    enforcement = pod_enforcement(node, annotations_of(pod).get(contract.POD_MEMORY_ENFORCEMENT))
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    names = [c.get("name", "") for c in containers]
    allowances = {(uid, name): Allowance({}, enforcement) for name in names}
    try:
        request = pod_request(pod, resources=resources)
    except ContractError:
        return allowances
    try:
        slots = slots_of(pod, unit=unit, request=request)
    except ContractError:
        slots = None
    if slots is None:
        for container in request.containers:
            mib = unit.to_mib(container.amount)
            allowances[(uid, container.name)] = Allowance(dict.fromkeys(gpus, mib), enforcement, request.mps)
        return allowances
    allowances = {key: Allowance({}, enforcement, request.mps) for key in allowances}
    for slot in slots:
        share = unit.to_mib(slot.share)
        allowances[(uid, slot.container)] = Allowance(dict.fromkeys(slot.indices, share), enforcement, request.mps)
    return allowances


def given_by_kubelet(
    allowances: Mapping[tuple[str, str], Allowance],
    uid: str,
    devices: Mapping[str, Sequence[str]],
    *,
    unit: MemoryUnit,
) -> dict[tuple[str, str], Allowance]:
    """The pod's allowances with, for each container the kubelet lists with devices (PodResources), what the
    kubelet gave it: one unit per device ID, on the GPU the ID names. That is what the container runs with,
    whatever its annotations say now (an owner may edit them after Allocate)."""
    updated = {}
    for name, ids in devices.items():
        key = (uid, name)
        known = allowances.get(key)
        if known is None or not ids:
            continue
        counts: dict[int, int] = {}
        for device in ids:
            gpu = gpu_of(device)
            if gpu is not None:
                counts[gpu] = counts.get(gpu, 0) + 1
        if counts:
            allocated = {gpu: unit.to_mib(count) for gpu, count in counts.items()}
            updated[key] = Allowance(allocated, known.enforcement, known.mps)
    return updated


def owner_ref(owner: CgroupOwner | None, pods: Mapping[str, PodBody]) -> ContainerRef | None:
    """The container a process runs in, from its cgroup owner and this node's pods by UID; None for a process
    of no pod, of a pod this node does not know (yet), or of no container the pod's status names (yet):
    nothing is done to a process that cannot be named."""
    if owner is None or owner.container_id is None:
        return None
    pod = pods.get(owner.pod_uid)
    if pod is None:
        return None
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        if container_id_of(container.get("containerID") or "") == owner.container_id:
            namespace, name = key_of(pod)
            return ContainerRef(owner.pod_uid, namespace, name, container.get("name", ""))
    return None
