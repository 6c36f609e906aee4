"""The annotation contract between the extender, the node daemon and the inspect tool.

Everything that crosses a process boundary through Kubernetes objects is named and formatted here, and only
here: resource names, the unit, Aliyun's pod annotations (kept byte-compatible so nodes can migrate one at a
time), the env that Allocate returns, and gpushared's own versioned additions. Nothing in this package does
I/O; parsing returns typed values or raises :class:`ContractError` naming the key, the value and the reason,
so that callers can turn it into an HTTP 4xx, a gRPC status or a pod Event without guessing.

One file per part, each owning its readers and writers: ``units`` (resources and units), ``aliyun`` (Aliyun's
annotations), ``env`` (what Allocate and a claim's CDI spec give a container), ``records`` (gpushared's own
annotation names), ``inventory`` and ``allocation`` (its versioned records), ``compute`` (compute shares),
``dra`` (the DRA driver's names and configuration), and ``reading`` (how any of it is read from a tenant's
text: bounds, numbers, JSON). Every public name is importable from ``gpushared.contract`` itself.
"""

from __future__ import annotations

from gpushared.contract import dra, reading
from gpushared.contract.aliyun import (
    ALIYUN_FRAMEWORK_ALLOCATION,
    ALIYUN_GPU_MEM_ASSIGNED,
    ALIYUN_GPU_MEM_ASSUME_TIME,
    ALIYUN_GPU_MEM_DEV,
    ALIYUN_GPU_MEM_IDX,
    ALIYUN_GPU_MEM_POD,
    parse_framework_allocation,
)
from gpushared.contract.allocation import (
    Allocation,
    ContainerShares,
    GpuShare,
    format_allocation,
    parse_allocation,
)
from gpushared.contract.compute import (
    POD_COMPUTE_LIMIT,
    POD_COMPUTE_REQUEST,
    ComputeShare,
    parse_compute,
    parse_compute_record,
    parse_thread_percentage,
)
from gpushared.contract.env import (
    ENV_GPU_MEM_CONTAINER,
    ENV_GPU_MEM_DEV,
    ENV_GPU_MEM_IDX,
    ENV_GPU_MEM_POD,
    ENV_MPS_ACTIVE_THREAD_PERCENTAGE,
    ENV_MPS_PINNED_DEVICE_MEM_LIMIT,
    ENV_MPS_PIPE_DIRECTORY,
    ENV_NVIDIA_VISIBLE_DEVICES,
)
from gpushared.contract.inventory import (
    LINK_WORD,
    GpuInfo,
    GpuInventory,
    format_inventory,
    parse_inventory,
)
from gpushared.contract.reading import (
    CONTRACT_VERSION,
    MAX_INT,
    MAX_INT_TEXT,
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    ContractError,
    NewerVersion,
    format_bool,
    parse_bool,
    parse_int,
)
from gpushared.contract.records import (
    ANNOTATION_DOMAIN,
    NODE_INVENTORY,
    POD_ALLOCATION,
    POD_MEMORY_ENFORCEMENT,
    POD_MPS,
    POD_MPS_THREAD_PERCENTAGE,
)
from gpushared.contract.units import (
    DEFAULT_RESOURCES,
    NODE_LABEL_GPUSHARE,
    MemoryUnit,
    ResourceNames,
)

__all__ = [
    "ALIYUN_FRAMEWORK_ALLOCATION",
    "ALIYUN_GPU_MEM_ASSIGNED",
    "ALIYUN_GPU_MEM_ASSUME_TIME",
    "ALIYUN_GPU_MEM_DEV",
    "ALIYUN_GPU_MEM_IDX",
    "ALIYUN_GPU_MEM_POD",
    "ANNOTATION_DOMAIN",
    "CONTRACT_VERSION",
    "DEFAULT_RESOURCES",
    "ENV_GPU_MEM_CONTAINER",
    "ENV_GPU_MEM_DEV",
    "ENV_GPU_MEM_IDX",
    "ENV_GPU_MEM_POD",
    "ENV_MPS_ACTIVE_THREAD_PERCENTAGE",
    "ENV_MPS_PINNED_DEVICE_MEM_LIMIT",
    "ENV_MPS_PIPE_DIRECTORY",
    "ENV_NVIDIA_VISIBLE_DEVICES",
    "LINK_WORD",
    "MAX_INT",
    "MAX_INT_TEXT",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "NODE_INVENTORY",
    "NODE_LABEL_GPUSHARE",
    "POD_ALLOCATION",
    "POD_COMPUTE_LIMIT",
    "POD_COMPUTE_REQUEST",
    "POD_MEMORY_ENFORCEMENT",
    "POD_MPS",
    "POD_MPS_THREAD_PERCENTAGE",
    "Allocation",
    "ComputeShare",
    "ContainerShares",
    "ContractError",
    "GpuInfo",
    "GpuInventory",
    "GpuShare",
    "MemoryUnit",
    "NewerVersion",
    "ResourceNames",
    "dra",
    "format_allocation",
    "format_bool",
    "format_inventory",
    "parse_allocation",
    "parse_bool",
    "parse_compute",
    "parse_compute_record",
    "parse_framework_allocation",
    "parse_int",
    "parse_inventory",
    "parse_thread_percentage",
    "reading",
]
