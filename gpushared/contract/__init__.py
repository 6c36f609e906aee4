"""The annotation contract between the extender, the node daemon and the inspect tool.

Everything that crosses a process boundary through Kubernetes objects is named and formatted here, and only
here: resource names, the unit, Aliyun's pod annotations (kept byte-compatible so nodes can migrate one at a
time), the env that Allocate returns, and gpushared's own versioned additions. Nothing in this module does
I/O; parsing returns typed values or raises :class:`ContractError` naming the key, the value and the reason,
so that callers can turn it into an HTTP 4xx, a gRPC status or a pod Event without guessing.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpushared.contract import reading
from gpushared.contract.reading import _load_json, _require_bool, _require_int, _require_str, _versioned_object

# What is public of how the contract's text is read (contract/reading.py), under the contract's name.
CONTRACT_VERSION: Final = reading.CONTRACT_VERSION
MAX_INT: Final = reading.MAX_INT
MAX_INT_TEXT: Final = reading.MAX_INT_TEXT
MAX_JSON_BYTES: Final = reading.MAX_JSON_BYTES
MAX_JSON_DEPTH: Final = reading.MAX_JSON_DEPTH
ContractError = reading.ContractError
NewerVersion = reading.NewerVersion
format_bool = reading.format_bool
parse_bool = reading.parse_bool
parse_int = reading.parse_int

# ---------------------------------------------------------------------------------------------------------
# Resources and units


class MemoryUnit(enum.Enum):
    """What one unit of the gpu-mem resource means on a node.

    Aliyun leaves the unit implicit and its inspect tool guesses it from the size of a GPU; we declare it in
    the node inventory and in every allocation so that nothing has to guess.
    """

    MIB = "MiB"
    GIB = "GiB"

    @property
    def mib(self) -> int:
        """MiB in one unit."""
        return 1 if self is MemoryUnit.MIB else 1024

    @classmethod
    def parse(cls, text: object, *, key: str = "unit") -> MemoryUnit:
        for unit in cls:
            if text == unit.value:
                return unit
        raise ContractError(key=key, value=text, reason="'unit' must be 'MiB' or 'GiB'")

    def from_mib(self, mib: int) -> int:
        """Whole units in ``mib`` MiB, rounded down: a GPU never advertises memory it does not have."""
        return mib // self.mib

    def to_mib(self, amount: int) -> int:
        return amount * self.mib

    def to_bytes(self, amount: int) -> int:
        """For metrics, which are in base units whatever the node's unit is."""
        return self.to_mib(amount) * 2**20

    def convert(self, amount: int, *, to: MemoryUnit) -> int:
        """``amount`` of this unit expressed in ``to``, rounded up: a holding is never under-counted."""
        return math.ceil(amount * self.mib / to.mib)


@dataclass(frozen=True)
class ResourceNames:
    """The extended resource names; the domain is configurable for clusters that run both stacks."""

    domain: str = "aliyun.com"

    @property
    def gpu_mem(self) -> str:
        return f"{self.domain}/gpu-mem"

    @property
    def gpu_count(self) -> str:
        return f"{self.domain}/gpu-count"


DEFAULT_RESOURCES: Final = ResourceNames()

#: Node label that Aliyun's DaemonSet selects on; kept so that existing node pools keep working.
NODE_LABEL_GPUSHARE: Final = "gpushare"

# ---------------------------------------------------------------------------------------------------------
# Aliyun pod annotations (written by the extender at bind, ASSIGNED flipped by the node daemon)

ALIYUN_GPU_MEM_IDX: Final = "ALIYUN_COM_GPU_MEM_IDX"
ALIYUN_GPU_MEM_DEV: Final = "ALIYUN_COM_GPU_MEM_DEV"
ALIYUN_GPU_MEM_POD: Final = "ALIYUN_COM_GPU_MEM_POD"
ALIYUN_GPU_MEM_ASSIGNED: Final = "ALIYUN_COM_GPU_MEM_ASSIGNED"
ALIYUN_GPU_MEM_ASSUME_TIME: Final = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
#: Written by Alibaba's closed "gpushare 2.0"; read (never written) so that inspect shows those pods.
ALIYUN_FRAMEWORK_ALLOCATION: Final = "scheduler.framework.gpushare.allocation"

# ---------------------------------------------------------------------------------------------------------
# Env returned by Allocate

ENV_NVIDIA_VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
ENV_GPU_MEM_IDX: Final = "ALIYUN_COM_GPU_MEM_IDX"
ENV_GPU_MEM_POD: Final = "ALIYUN_COM_GPU_MEM_POD"
ENV_GPU_MEM_CONTAINER: Final = "ALIYUN_COM_GPU_MEM_CONTAINER"
ENV_GPU_MEM_DEV: Final = "ALIYUN_COM_GPU_MEM_DEV"
ENV_MPS_PIPE_DIRECTORY: Final = "CUDA_MPS_PIPE_DIRECTORY"
ENV_MPS_ACTIVE_THREAD_PERCENTAGE: Final = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_MPS_PINNED_DEVICE_MEM_LIMIT: Final = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

# ---------------------------------------------------------------------------------------------------------
# gpushared's own annotations, versioned in their JSON bodies

ANNOTATION_DOMAIN: Final = "gpushared.io"
#: Node: the GPUs the daemon found, with their own sizes and health (Aliyun assumes equal sizes).
NODE_INVENTORY: Final = f"{ANNOTATION_DOMAIN}/gpu-inventory"
#: Pod: container -> GPU -> amount, so that Allocate (called once per container) can be exact.
POD_ALLOCATION: Final = f"{ANNOTATION_DOMAIN}/allocation"
#: Pod: "true" opts the pod into the GPU's MPS server.
POD_MPS: Final = f"{ANNOTATION_DOMAIN}/mps"
#: Pod: overrides the derived CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (1-100).
POD_MPS_THREAD_PERCENTAGE: Final = f"{ANNOTATION_DOMAIN}/mps-active-thread-percentage"
#: Pod: "off", "report" or "kill": what the daemon does when the pod's containers use more GPU memory than
#: they were allocated; only stricter than the node's setting takes effect (core.node.memory).
POD_MEMORY_ENFORCEMENT: Final = f"{ANNOTATION_DOMAIN}/memory-enforcement"


#: Pod: the share of each of its GPUs' compute (SMs) the pod is guaranteed, in percent (0-100): scheduled,
#: so the requests on one GPU never sum past 100 (docs/design.md, "Compute shares").
POD_COMPUTE_REQUEST: Final = f"{ANNOTATION_DOMAIN}/gpu-compute-request"
#: Pod: the most of each of its GPUs' compute any of its containers may use, in percent (1-100): the MPS
#: thread percentage of an MPS pod; measured and reported for the others.
POD_COMPUTE_LIMIT: Final = f"{ANNOTATION_DOMAIN}/gpu-compute-limit"


def parse_thread_percentage(text: object) -> int:
    return parse_int(POD_MPS_THREAD_PERCENTAGE, text, minimum=1, maximum=100)


@dataclass(frozen=True)
class ComputeShare:
    """A pod's compute on each of its GPUs, in percent: at least ``request``, at most ``limit``."""

    request: int = 0
    limit: int = 100

    def __post_init__(self) -> None:
        if not 0 <= self.request <= self.limit <= 100 or self.limit < 1:
            raise ContractError(
                key=POD_COMPUTE_REQUEST,
                value={"request": self.request, "limit": self.limit},
                reason="must be 0 <= request <= limit <= 100 and limit >= 1 (percent of one GPU's compute)",
            )


def parse_compute(annotations: Mapping[str, str]) -> ComputeShare | None:
    """The pod's compute share from its annotations; None when it gives neither (compute then unscheduled,
    as before compute shares existed). A request alone is capped at 100, a limit alone guarantees nothing."""
    request_text, limit_text = annotations.get(POD_COMPUTE_REQUEST), annotations.get(POD_COMPUTE_LIMIT)
    if request_text is None and limit_text is None:
        return None
    request = 0 if request_text is None else parse_int(POD_COMPUTE_REQUEST, request_text, maximum=100)
    limit = 100 if limit_text is None else parse_int(POD_COMPUTE_LIMIT, limit_text, minimum=1, maximum=100)
    if request > limit:
        raise ContractError(
            key=POD_COMPUTE_REQUEST,
            value=request_text,
            reason=f"is more than {POD_COMPUTE_LIMIT} ({limit}): a pod cannot be guaranteed more than it may use",
        )
    return ComputeShare(request=request, limit=limit)


def parse_framework_allocation(text: str) -> dict[int, dict[int, int]]:
    """Alibaba's closed scheduler's ``{"<container index>": {"<gpu index>": amount}}``."""
    key = ALIYUN_FRAMEWORK_ALLOCATION
    body = _load_json(key, text)
    if not isinstance(body, dict):
        raise ContractError(key=key, value=text, reason="expected a JSON object")
    result: dict[int, dict[int, int]] = {}
    for container, gpus in body.items():
        if not isinstance(gpus, dict):
            raise ContractError(key=key, value=text, reason=f"container {container}: expected an object")
        result[parse_int(key, container)] = {
            parse_int(key, gpu): _require_int(key, f"container {container} gpu {gpu}", amount)
            for gpu, amount in gpus.items()
        }
    return result


# ---------------------------------------------------------------------------------------------------------
# The node GPU inventory


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as the node daemon reports it.

    ``index`` is NVML's enumeration index (the same one the daemon resolves to ``uuid``); ``memory`` is in
    the node's unit, rounded down; ``memory_mib`` is NVML's exact total, which MPS limits are derived from.
    ``used_mib`` is what the GPU's processes used when the daemon last published it (None: not watched); it
    is not part of a GPU's identity, so a change of use alone changes no ledger.
    """

    index: int
    uuid: str
    model: str
    memory: int
    memory_mib: int
    healthy: bool = True
    mps_capable: bool = False
    used_mib: int | None = dataclasses.field(default=None, compare=False)
    #: the NUMA node the GPU hangs off (None: not known), for the kubelet's Topology Manager
    numa: int | None = None


#: One link of the inventory's ``links``: ``nvidia-smi topo -m``'s words (``NV<n>``: n NVLink links; PIX,
#: PXB, PHB, NODE, SYS: PCIe paths, best first; PIX-BOARD: one board; ``?``: not known).
LINK_WORD: Final = re.compile(r"NV[1-9][0-9]{0,2}|PIX-BOARD|PIX|PXB|PHB|NODE|SYS|\?")


@dataclass(frozen=True)
class GpuInventory:
    """All GPUs of one node. One unit per node: a node advertises one gpu-mem resource.

    ``links`` is how the GPUs are connected (``core.shared.topology``): the upper triangle of the link matrix over
    ``gpus`` in order, row by row (GPU 0 to 1, 2, ...; then 1 to 2, ...), empty when not read. In the
    annotation it is one string of words (28 for 8 GPUs); readers older than it ignore the key."""

    unit: MemoryUnit
    gpus: tuple[GpuInfo, ...]
    links: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        indices = [gpu.index for gpu in self.gpus]
        if indices != sorted(set(indices)):
            raise ContractError(key=NODE_INVENTORY, value=indices, reason="GPU indices must be unique, ascending")
        uuids = [gpu.uuid for gpu in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ContractError(key=NODE_INVENTORY, value=uuids, reason="GPU UUIDs must be unique")
        pairs = len(self.gpus) * (len(self.gpus) - 1) // 2
        if self.links and len(self.links) != pairs:
            raise ContractError(
                key=NODE_INVENTORY,
                value=" ".join(self.links),
                reason=f"'links' must name {pairs} pairs for {len(self.gpus)} GPUs",
            )
        for word in self.links:
            if not LINK_WORD.fullmatch(word):
                raise ContractError(
                    key=NODE_INVENTORY, value=word, reason="not a link: NV<n>, PIX, PXB, PHB, NODE, SYS or ?"
                )

    def by_index(self, index: int) -> GpuInfo | None:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        return None

    @property
    def total(self) -> int:
        return sum(gpu.memory for gpu in self.gpus)


def format_inventory(inventory: GpuInventory) -> str:
    return json.dumps(
        {
            "version": CONTRACT_VERSION,
            "unit": inventory.unit.value,
            "gpus": [
                {
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "model": gpu.model,
                    "memory": gpu.memory,
                    "memoryMiB": gpu.memory_mib,
                    "healthy": gpu.healthy,
                    "mps": gpu.mps_capable,
                    **({"usedMiB": gpu.used_mib} if gpu.used_mib is not None else {}),
                    **({"numa": gpu.numa} if gpu.numa is not None else {}),
                }
                for gpu in inventory.gpus
            ],
            **({"links": " ".join(inventory.links)} if inventory.links else {}),
        },
        separators=(",", ":"),
    )


def parse_inventory(text: str) -> GpuInventory:
    key = NODE_INVENTORY
    body = _versioned_object(key, text)
    unit = MemoryUnit.parse(body.get("unit"), key=key)
    gpus = body.get("gpus")
    if not isinstance(gpus, list):
        raise ContractError(key=key, value=text, reason="'gpus' must be a list")
    parsed = []
    for position, gpu in enumerate(gpus):
        where = f"gpus[{position}]"
        if not isinstance(gpu, dict):
            raise ContractError(key=key, value=text, reason=f"{where} must be an object")
        parsed.append(
            GpuInfo(
                index=_require_int(key, f"{where}.index", gpu.get("index")),
                uuid=_require_str(key, f"{where}.uuid", gpu.get("uuid")),
                model=_require_str(key, f"{where}.model", gpu.get("model", "")),
                memory=_require_int(key, f"{where}.memory", gpu.get("memory")),
                memory_mib=_require_int(key, f"{where}.memoryMiB", gpu.get("memoryMiB")),
                healthy=_require_bool(key, f"{where}.healthy", gpu.get("healthy", True)),
                mps_capable=_require_bool(key, f"{where}.mps", gpu.get("mps", False)),
                used_mib=_require_int(key, f"{where}.usedMiB", gpu["usedMiB"]) if "usedMiB" in gpu else None,
                numa=_require_int(key, f"{where}.numa", gpu["numa"]) if "numa" in gpu else None,
            )
        )
    links = body.get("links", "")
    if not isinstance(links, str):
        raise ContractError(key=key, value=links, reason="'links' must be a string of link words")
    return GpuInventory(unit=unit, gpus=tuple(parsed), links=tuple(links.split()))


# ---------------------------------------------------------------------------------------------------------
# The per-container allocation


@dataclass(frozen=True)
class GpuShare:
    """``amount`` units of the GPU at ``index``; ``uuid`` lets the daemon refuse a GPU that moved."""

    index: int
    uuid: str
    amount: int


@dataclass(frozen=True)
class ContainerShares:
    """The GPU memory of one container. ``init`` and ``sidecar`` matter for what the pod holds at once:
    init containers run one after another before the app containers, sidecars (restartable init
    containers) keep running beside them (KEP-753), and kubelet hands init containers' devices on."""

    name: str
    gpus: tuple[GpuShare, ...]
    init: bool = False
    sidecar: bool = False


@dataclass(frozen=True)
class Allocation:
    """What the extender decided for one pod: every GPU-using container, init containers first, in the
    order of the pod spec."""

    unit: MemoryUnit
    containers: tuple[ContainerShares, ...]
    #: the pod's compute share on each of its GPUs, as bound; None for a pod that asked for none
    compute: ComputeShare | None = None

    def __post_init__(self) -> None:
        names = [c.name for c in self.containers]
        if len(set(names)) != len(names):
            raise ContractError(key=POD_ALLOCATION, value=names, reason="container names must be unique")

    def for_container(self, name: str) -> ContainerShares | None:
        for container in self.containers:
            if container.name == name:
                return container
        return None


def format_allocation(allocation: Allocation) -> str:
    def shares(container: ContainerShares) -> list[dict[str, object]]:
        return [{"index": s.index, "uuid": s.uuid, "amount": s.amount} for s in container.gpus]

    body: dict[str, object] = {
        "version": CONTRACT_VERSION,
        "unit": allocation.unit.value,
        "initContainers": [
            {"name": c.name, "sidecar": c.sidecar, "gpus": shares(c)} for c in allocation.containers if c.init
        ],
        "containers": [{"name": c.name, "gpus": shares(c)} for c in allocation.containers if not c.init],
    }
    if allocation.compute is not None:  # absent otherwise: readers from before compute shares see no change
        body["compute"] = {"request": allocation.compute.request, "limit": allocation.compute.limit}
    return json.dumps(body, separators=(",", ":"))


def parse_allocation(text: str) -> Allocation:
    key = POD_ALLOCATION
    body = _versioned_object(key, text)
    unit = MemoryUnit.parse(body.get("unit"), key=key)
    parsed: list[ContainerShares] = []
    for field, init in (("initContainers", True), ("containers", False)):
        entries = body.get(field, [])
        if not isinstance(entries, list):
            raise ContractError(key=key, value=text, reason=f"'{field}' must be a list")
        for position, entry in enumerate(entries):
            where = f"{field}[{position}]"
            if not isinstance(entry, dict):
                raise ContractError(key=key, value=text, reason=f"{where} must be an object")
            gpus = entry.get("gpus")
            if not isinstance(gpus, list) or not gpus:
                raise ContractError(key=key, value=text, reason=f"{where}.gpus must list at least one GPU")
            parsed.append(
                ContainerShares(
                    name=_require_str(key, f"{where}.name", entry.get("name")),
                    gpus=tuple(_parse_share(key, f"{where}.gpus[{i}]", share) for i, share in enumerate(gpus)),
                    init=init,
                    sidecar=init and _require_bool(key, f"{where}.sidecar", entry.get("sidecar", False)),
                )
            )
    if not parsed:
        raise ContractError(key=key, value=text, reason="no container holds GPU memory")
    return Allocation(unit=unit, containers=tuple(parsed), compute=_parse_compute_record(key, body.get("compute")))


def _parse_compute_record(key: str, record: object) -> ComputeShare | None:
    if record is None:
        return None
    if not isinstance(record, dict):
        raise ContractError(key=key, value=record, reason="'compute' must be an object")
    request = _require_int(key, "compute.request", record.get("request", 0))
    limit = _require_int(key, "compute.limit", record.get("limit", 100))
    try:
        return ComputeShare(request=request, limit=limit)
    except ContractError as exc:
        raise ContractError(key=key, value=record, reason=f"compute: {exc.reason}") from None


def _parse_share(key: str, where: str, share: object) -> GpuShare:
    if not isinstance(share, dict):
        raise ContractError(key=key, value=share, reason=f"{where} must be an object")
    return GpuShare(
        index=_require_int(key, f"{where}.index", share.get("index")),
        uuid=_require_str(key, f"{where}.uuid", share.get("uuid")),
        amount=_require_int(key, f"{where}.amount", share.get("amount")),
    )
