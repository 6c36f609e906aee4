"""One node's GPUs and what the pods on it hold: the accounting every component agrees on.

The ledger is derived, never persisted: the node inventory annotation says what GPUs exist, and each pod's
annotations say what it holds. Rebuilding it from the API server after a restart therefore gives the same
numbers the extender had before, which is what makes the extender restart-safe and lets two replicas agree.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from gpushared import contract
from gpushared.contract import ContractError, GpuInfo, GpuInventory, MemoryUnit, ResourceNames
from gpushared.core.shared.bodies import NodeBody, PodBody, annotations_of, meta_of, priority_of
from gpushared.core.shared.quantity import parse_whole_quantity
from gpushared.core.shared.requests import ContainerRequest, PodRequest, peak, pod_request, spec_request


@dataclass(frozen=True)
class GpuVerdict:
    """Whether one GPU can take the pod; ``reason`` says why not, in words a person acts on. Judged by
    ``core.shared.verdicts``; kept here, beside the book it reads, so that the book's derived views can name it
    without the two modules importing each other."""

    gpu: GpuInfo
    free: int
    reason: str | None

    @property
    def fits(self) -> bool:
        return self.reason is None


class GpuMode(enum.Enum):
    """How a GPU is being shared right now. MPS and plain time-sliced clients must not mix on one GPU:
    with the MPS server in exclusive mode the others fail, and without it they escape its limits."""

    EMPTY = "empty"
    SHARED = "shared"
    MPS = "mps"


@dataclass(frozen=True, slots=True)
class Holding:
    """What one pod holds on this node, in the ledger's memory unit."""

    uid: str
    namespace: str
    name: str
    #: GPU index -> units held there at the pod's peak
    gpus: Mapping[int, int]
    mps: bool = False
    #: units of a pod bound here without a GPU choice (it bypassed the extender, or its annotations are
    #: unreadable, as ``problem`` then says): they count against the node, not a GPU
    pending: int = 0
    assigned: bool = False
    problem: str | None = None
    #: percent of the compute of each GPU in ``gpus`` (of the node's, while ``pending``) guaranteed to it
    compute: int = 0
    #: not a pod: room the claim allocator keeps free for kube-scheduler (``core.placement.claims.room``),
    #: counted against the GPU's memory and compute and never as a pod on it (no sharer, no MPS or plain mode)
    kept: bool = False
    #: the pod's priority: who may be evicted for whom (``core.placement.preemption``)
    priority: int = 0


def holds_gpu_memory(pod: PodBody) -> bool:
    """Whether the pod's GPU memory is still in use.

    A finished pod (Succeeded/Failed) frees it. A terminating pod does not: its processes keep their GPU
    memory until the containers have stopped, so we free it only once every container status says so.
    Aliyun frees at the deletion timestamp, and the next pod then runs out of memory on a busy GPU.
    """
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return False
    if not meta_of(pod).get("deletionTimestamp"):
        return True
    statuses = list(status.get("containerStatuses") or [])
    if not statuses:
        return True
    return not all((s.get("state") or {}).get("terminated") for s in statuses)


def holding_from_pod(
    pod: PodBody, *, unit: MemoryUnit, resources: ResourceNames = contract.DEFAULT_RESOURCES
) -> Holding | None:
    """What ``pod`` holds, in ``unit``, or None if it holds no GPU memory (any more).

    The GPU choice comes from the annotations, most exact first: our allocation annotation; Alibaba's
    framework allocation; Aliyun's ``ALIYUN_COM_GPU_MEM_IDX``. The amount never falls below what the pod's
    spec asks on each GPU: the spec cannot change once the pod exists, while its owner can edit its
    annotations (an allocation or ``_POD`` patched to 0 once freed a running pod's memory in every book).
    A pod on fewer GPUs than its spec asks holds the rest as pending, and one whose annotations cannot be
    read is held as pending with the reason, so that memory is never silently given away twice. A placed
    pod's compute is its bind record's, never its compute annotations' (its owner may edit those).
    """
    if not holds_gpu_memory(pod):
        return None
    meta = meta_of(pod)
    annotations = annotations_of(pod)
    problems: list[str] = []
    try:
        request = pod_request(pod, resources=resources)
    except ContractError as exc:
        problems.append(str(exc))
        try:
            request = spec_request(pod, resources=resources)  # still counted at what its spec asks
        except ContractError:
            request = PodRequest(containers=())
    recorded: contract.ComputeShare | None = None
    try:
        gpus, recorded = _gpus_from_annotations(annotations, unit=unit)
    except ContractError as exc:
        gpus = None
        problems.append(str(exc))
    if not gpus:
        gpus = None  # an empty choice (Alibaba's framework allocation may be "{}") is no choice: pending
    if gpus is None and request.total == 0 and not problems:
        return None
    # A placed pod holds the compute its bind recorded (none, where its record has no share: Aliyun's
    # stack and releases before compute shares promised none), whatever its owner's annotations say since:
    # an edit never moves a neighbour's room. A pod still waiting holds what it asks.
    compute = request.compute_request if gpus is None else (recorded.request if recorded is not None else 0)
    pending = request.total if gpus is None else 0
    if gpus and request.total:
        gpus = {index: max(amount, request.per_gpu) for index, amount in gpus.items()}
        missing = request.gpus - len(gpus)
        if missing > 0:
            pending = missing * request.per_gpu
            problems.append(f"its annotations name {len(gpus)} GPUs, its spec asks for {request.gpus}")
    return Holding(
        uid=meta.get("uid", ""),
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        gpus=gpus or {},
        mps=request.mps,
        pending=pending,
        assigned=annotations.get(contract.ALIYUN_GPU_MEM_ASSIGNED) == "true",
        problem="; ".join(problems) or None,
        compute=compute,
        priority=priority_of(pod),
    )


def recorded_compute(annotations: Mapping[str, str]) -> contract.ComputeShare | None:
    """The compute share the pod's bind recorded in its allocation: what its GPU's share was given on,
    counted and capped even when the pod's own compute annotations were edited since (its owner may). None
    where no share was recorded, or the record does not read (``_gpus_from_annotations`` reports that)."""
    text = annotations.get(contract.POD_ALLOCATION)
    if text is None:
        return None
    try:
        return contract.parse_allocation(text).compute
    except ContractError:
        return None


def _gpus_from_annotations(
    annotations: Mapping[str, str], *, unit: MemoryUnit
) -> tuple[dict[int, int] | None, contract.ComputeShare | None]:
    """Units held per GPU, from the most exact record there is, and the compute share our allocation
    recorded (read from the one parse: this runs for every pod event the extender's cache sees)."""
    if contract.POD_ALLOCATION in annotations:
        try:
            allocation = contract.parse_allocation(annotations[contract.POD_ALLOCATION])
        except contract.NewerVersion:
            # Written by a newer extender (a rollback in progress). Its Binding wrote Aliyun's keys too: for
            # a pod on one GPU they name the same GPU and amount, so the pod keeps its GPU in these books.
            # A pod on several GPUs (_IDX -1) or without them stays pending, with the reason.
            if annotations.get(contract.ALIYUN_GPU_MEM_IDX, "-1") == "-1":
                raise
        else:
            return holds_per_gpu(allocation, unit=unit), allocation.compute
    if contract.ALIYUN_FRAMEWORK_ALLOCATION in annotations:
        held: dict[int, int] = {}
        for gpus in contract.parse_framework_allocation(annotations[contract.ALIYUN_FRAMEWORK_ALLOCATION]).values():
            for index, amount in gpus.items():
                held[index] = held.get(index, 0) + amount
        return held, None
    if contract.ALIYUN_GPU_MEM_IDX in annotations:
        index = contract.parse_int(contract.ALIYUN_GPU_MEM_IDX, annotations[contract.ALIYUN_GPU_MEM_IDX])
        amount = contract.parse_int(contract.ALIYUN_GPU_MEM_POD, annotations.get(contract.ALIYUN_GPU_MEM_POD))
        return {index: amount}, None
    return None, None


def holds_per_gpu(allocation: contract.Allocation, *, unit: MemoryUnit) -> dict[int, int]:
    """Units held at the pod's peak on each GPU of ``allocation``, converted to ``unit``."""
    indices = sorted({share.index for c in allocation.containers for share in c.gpus})
    held = {}
    for index in indices:
        on_gpu = (
            ContainerRequest(
                name=c.name,
                amount=sum(s.amount for s in c.gpus if s.index == index),
                init=c.init,
                sidecar=c.sidecar,
            )
            for c in allocation.containers
        )
        held[index] = allocation.unit.convert(peak(on_gpu), to=unit)
    return held


def inventory_from_node(
    node: NodeBody, *, resources: ResourceNames = contract.DEFAULT_RESOURCES
) -> GpuInventory | None:
    """The node's GPUs: from the inventory annotation, or for an Aliyun node from its capacity.

    Aliyun nodes advertise ``gpu-mem`` capacity and ``gpu-count``; each GPU is assumed to be capacity/count
    (Aliyun's own assumption) and the unit is guessed the way its inspect tool does (more than 100 units per
    GPU means MiB). None for a node that shares no GPU.
    """
    meta = meta_of(node)
    annotations = annotations_of(node)
    if contract.NODE_INVENTORY in annotations:
        return contract.parse_inventory(annotations[contract.NODE_INVENTORY])
    capacity = (node.get("status") or {}).get("capacity") or {}
    if resources.gpu_mem not in capacity:
        return None
    total = parse_whole_quantity(f"status.capacity[{resources.gpu_mem}]", capacity[resources.gpu_mem])
    count = parse_whole_quantity(f"status.capacity[{resources.gpu_count}]", capacity.get(resources.gpu_count, "0"))
    if total <= 0 or count <= 0:
        return None
    per_gpu = total // count
    unit = MemoryUnit.MIB if per_gpu > 100 else MemoryUnit.GIB
    gpus = tuple(
        GpuInfo(
            index=i,
            uuid=f"aliyun-{meta.get('name', '')}-{i}",
            model="",
            memory=per_gpu,
            memory_mib=unit.to_mib(per_gpu),
        )
        for i in range(count)
    )
    return GpuInventory(unit=unit, gpus=gpus)


@dataclass
class Ledger:
    """The GPUs of one node and the holdings on them. Placement only ever adds a holding that fits; a
    ledger rebuilt from a cluster that is already over capacity (it happens under Aliyun) shows it as is."""

    inventory: GpuInventory
    _holdings: dict[str, Holding] = field(default_factory=dict)
    _used: dict[int, int] = field(default_factory=dict)
    _mps: dict[int, int] = field(default_factory=dict)
    _shared: dict[int, int] = field(default_factory=dict)
    #: GPU index -> percent of its compute the pods on it are guaranteed (``Holding.compute``)
    _compute: dict[int, int] = field(default_factory=dict)
    #: compute guaranteed to pods on no known GPU: taken from every GPU's, like ``_unplaced``
    _unplaced_compute: int = 0
    #: units held on this node on no known GPU (``Holding.pending``): which GPU they use cannot be read, so
    #: they are taken from the room of every GPU (``free``): never given away on the one they really use
    _unplaced: int = 0
    #: changes whenever a holding comes or goes (``add``, ``remove``: nobody else writes it), so what is
    #: derived from a ledger can be kept until then. A plain attribute, not a property: the extender reads it
    #: for every candidate of every call (extender/index.py)
    version: int = 0
    _views: LedgerViews | None = field(default=None, compare=False, repr=False)

    def views(self) -> LedgerViews:
        """What pricing derives from the ledger as it is (core/shared/verdicts.py, core/placement/policies.py): new, and
        empty, whenever a holding came or went since they were derived."""
        views = self._views
        if views is None or views.version != self.version:
            views = self._views = LedgerViews(self.version)
        return views

    @classmethod
    def build(cls, inventory: GpuInventory, holdings: Iterable[Holding] = ()) -> Ledger:
        ledger = cls(inventory)
        for holding in holdings:
            ledger.add(holding)
        return ledger

    @property
    def unit(self) -> MemoryUnit:
        return self.inventory.unit

    def add(self, holding: Holding) -> None:
        """Record ``holding``, replacing what the same pod held before."""
        self.remove(holding.uid)
        self._holdings[holding.uid] = holding
        self._count(holding, +1)

    def remove(self, uid: str) -> Holding | None:
        holding = self._holdings.pop(uid, None)
        if holding is not None:
            self._count(holding, -1)
        return holding

    def _count(self, holding: Holding, sign: int) -> None:
        self.version += 1
        modes = self._mps if holding.mps else self._shared
        self._unplaced += sign * holding.pending
        if holding.pending and holding.compute:
            self._unplaced_compute += sign * holding.compute
        for index, amount in holding.gpus.items():
            _bump(self._used, index, sign * amount)
            if not holding.kept:
                _bump(modes, index, sign)
            if holding.compute:
                _bump(self._compute, index, sign * holding.compute)

    def holding(self, uid: str) -> Holding | None:
        return self._holdings.get(uid)

    def holdings(self) -> Iterator[Holding]:
        return iter(self._holdings.values())

    def used(self, index: int) -> int:
        return self._used.get(index, 0)

    def free(self, gpu: GpuInfo) -> int:
        """What a new pod may take on ``gpu``: its memory less what is held there and what is held on the
        node on no known GPU (``pending``)."""
        return gpu.memory - self.used(gpu.index) - self._unplaced

    @property
    def holds_compute(self) -> bool:
        """Whether any pod here holds a compute request (fgd's fragment then reads compute too)."""
        return bool(self._compute) or self._unplaced_compute > 0

    def compute_used(self, index: int) -> int:
        """Percent of GPU ``index``'s compute its pods are guaranteed."""
        return self._compute.get(index, 0)

    def compute_free(self, index: int) -> int:
        """Percent of GPU ``index``'s compute a new pod may be guaranteed: what its pods and the pods on no
        known GPU are not."""
        return 100 - self._compute.get(index, 0) - self._unplaced_compute

    def mode(self, index: int) -> GpuMode:
        if self._mps.get(index):
            return GpuMode.MPS
        if self._shared.get(index):
            return GpuMode.SHARED
        return GpuMode.EMPTY

    def mps_clients(self, index: int) -> int:
        return self._mps.get(index, 0)

    def sharers(self, index: int) -> int:
        """Pods on GPU ``index``, MPS or not: what the balanced policy evens out."""
        return self._mps.get(index, 0) + self._shared.get(index, 0)

    @property
    def pending(self) -> int:
        return self._unplaced

    @property
    def used_total(self) -> int:
        """Units in use on the node, pending pods included (as Aliyun's inspect counts them)."""
        return sum(self._used.values()) + self.pending

    def orphaned(self) -> dict[int, int]:
        """Units held on GPU indices the inventory no longer has (a GPU removed or lost)."""
        known = {gpu.index for gpu in self.inventory.gpus}
        return {index: used for index, used in self._used.items() if index not in known}


@dataclass
class LedgerViews:
    """What pricing derives from one version of a ledger, each kind in a typed slot of its own: the
    verdicts of the GPUs a kind of pod may use, those in order of free memory, and the healthy GPUs' free
    memory. Every prioritize reads them for a thousand nodes, and the ledger changes with one bind."""

    version: int
    #: (MPS, the most MPS clients a GPU takes) -> the usable GPUs' verdicts (``verdicts.usable``)
    usable: dict[tuple[bool, int], tuple[GpuVerdict, ...]] = field(default_factory=dict)
    #: the same key -> their free units in order, and the verdicts in that order (``verdicts.by_free``)
    by_free: dict[tuple[bool, int], tuple[list[int], tuple[GpuVerdict, ...]]] = field(default_factory=dict)
    #: (GPU index -> position, free units per position, units in all, free units in all) of the healthy
    #: GPUs (``pricing.PricingContext``)
    healthy: tuple[dict[int, int], list[int], int, int] | None = None


def _bump(counts: dict[int, int], index: int, delta: int) -> None:
    """Add ``delta``, dropping keys that reach zero so the maps stay as small as the busy GPUs."""
    value = counts.get(index, 0) + delta
    if value:
        counts[index] = value
    else:
        counts.pop(index, None)
