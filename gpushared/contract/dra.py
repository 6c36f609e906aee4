"""The names and formats of gpushared as a DRA driver (Kubernetes >= 1.34, ``resource.k8s.io/v1``).

On a node in DRA mode the daemon publishes each GPU once, in a ResourceSlice, as a device that many claims
may share (``allowMultipleAllocations``), each consuming part of its ``memory`` and ``compute`` capacity;
kube-scheduler allocates claims against those capacities by itself (KEP-5075, consumable capacity), and the
daemon prepares what it allocated (docs/dra.md). Everything that crosses a process boundary in that mode is
named here: the driver, the device class, the device names and attributes, the capacities and the opaque
configuration a claim may carry. Pure, like the rest of the contract.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpushared.contract.reading import ContractError

#: The driver's name: ResourceSlices' ``spec.driver``, allocation results' ``driver``, the kubelet plugin's name.
DRIVER: Final = "gpu.gpushared.io"
#: The DeviceClass the chart ships (deploy/dra/): every device of this driver.
DEVICE_CLASS: Final = "gpu-mem.gpushared.io"
#: The group the kubelet and the scheduler read it from; v1 is GA since Kubernetes 1.34.
API_GROUP: Final = "resource.k8s.io"
API_VERSION: Final = "v1"
#: The finalizer kube-scheduler puts on every claim it allocates (``resourceapi.Finalizer``): once the last pod
#: a claim is reserved for is gone, kube-controller-manager clears the allocation of a claim that has it, and
#: of no other. The claim allocator puts it on too, or a standalone claim would hold its GPUs for ever.
ALLOCATED_FINALIZER: Final = "resource.kubernetes.io/delete-protection"

# Device attributes (``device.attributes["gpu.gpushared.io"].<name>`` in CEL).
ATTRIBUTE_UUID: Final = "uuid"
ATTRIBUTE_INDEX: Final = "index"
ATTRIBUTE_PRODUCT: Final = "productName"
ATTRIBUTE_NUMA: Final = "numaNode"
ATTRIBUTE_MPS: Final = "mpsCapable"
#: GPUs joined by NVLink, directly or through each other, share this value; a GPU with no NVLink has none.
#: A claim for two linked GPUs says ``matchAttribute: gpu.gpushared.io/nvlinkDomain``.
ATTRIBUTE_NVLINK_DOMAIN: Final = "nvlinkDomain"

# Consumable capacities.
#: GPU memory, in bytes (a quantity: ``4Gi``); consumed in steps of the node's unit.
CAPACITY_MEMORY: Final = "memory"
#: The GPU's compute, in percent (``25``): what the claim is guaranteed; a claim that names none consumes 0.
CAPACITY_COMPUTE: Final = "compute"

#: The CDI kind of the specs the driver writes, one per prepared claim: ``gpushared.io/claim=<name>``.
CDI_VENDOR: Final = "gpushared.io"
CDI_CLASS: Final = "claim"
CDI_KIND: Final = f"{CDI_VENDOR}/{CDI_CLASS}"

#: The opaque configuration a claim (or a class) may give this driver.
CONFIG_API_VERSION: Final = "gpushared.io/v1alpha1"
CONFIG_KIND: Final = "GpuConfig"
_CONFIG_FIELDS: Final = frozenset({"apiVersion", "kind", "mps", "computeLimit"})

_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_MAX: Final = 63


@dataclass(frozen=True)
class GpuConfig:
    """What a claim asks of its GPUs beyond memory and compute.

    ``mps``: its containers are clients of the GPU's MPS control daemon, held to the claim's memory
    (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and to ``compute_limit`` percent of the GPU's threads
    (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``; without it, the compute the claim consumed, else its share of the
    GPU's memory, as for a device-plugin pod).
    """

    mps: bool = False
    compute_limit: int | None = None


def parse_gpu_config(parameters: object, *, where: str = "opaque parameters") -> GpuConfig:
    """A claim's ``config[].opaque.parameters`` for this driver; :class:`ContractError` naming the field."""
    key = f"{DRIVER} {where}"
    if not isinstance(parameters, Mapping):
        raise ContractError(key=key, value=parameters, reason="expected an object")
    if parameters.get("apiVersion") != CONFIG_API_VERSION or parameters.get("kind") != CONFIG_KIND:
        raise ContractError(
            key=key,
            value={"apiVersion": parameters.get("apiVersion"), "kind": parameters.get("kind")},
            reason=f"expected apiVersion {CONFIG_API_VERSION}, kind {CONFIG_KIND}",
        )
    unknown = sorted(str(name) for name in parameters if name not in _CONFIG_FIELDS)
    if unknown:
        raise ContractError(
            key=key, value=unknown, reason=f"unknown fields (known: {', '.join(sorted(_CONFIG_FIELDS))})"
        )
    mps = parameters.get("mps", False)
    if not isinstance(mps, bool):
        raise ContractError(key=f"{key}.mps", value=mps, reason="expected true or false")
    limit = parameters.get("computeLimit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100):
        raise ContractError(key=f"{key}.computeLimit", value=limit, reason="expected an integer percentage, 1-100")
    return GpuConfig(mps=mps, compute_limit=limit)


#: What a claim UID may be (the API server's are UUIDs). It names the claim's CDI spec and checkpoint record,
#: so it is checked wherever it comes from (the kubelet, a checkpoint) and can never be a path.
CLAIM_UID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def is_claim_uid(uid: object) -> bool:
    return isinstance(uid, str) and CLAIM_UID.fullmatch(uid) is not None


def device_name(uuid: str) -> str:
    """The device of the GPU with this NVML UUID: ``gpu-<uuid>``, lower case, a DNS label.

    Named by UUID, not index: a claim allocated against one GPU can never be prepared on another that took
    its index after a driver reload or a swap. Characters a DNS label does not allow become ``-``.
    """
    body = uuid.lower().removeprefix("gpu-")
    body = re.sub(r"[^a-z0-9-]", "-", body).strip("-")
    name = f"gpu-{body}"[:DNS_LABEL_MAX].rstrip("-")
    if not _LABEL.fullmatch(name):
        raise ContractError(key="device name", value=uuid, reason="a GPU UUID must give a DNS label")
    return name


def cdi_device_id(name: str) -> str:
    """The fully qualified CDI name of one of the driver's CDI devices."""
    return f"{CDI_KIND}={name}"


def claim_spec(
    *, count: int = 1, capacity: dict[str, str] | None = None, request: str = "gpu", **exactly: Any
) -> dict[str, Any]:
    """A ResourceClaim's ``spec`` as a user writes it for this driver's class: one request of ``count``
    GPUs, each consuming ``capacity`` (``memory``, ``compute``; none: the GPU whole). What the replay's
    claims and the tests' are."""
    body: dict[str, Any] = {"deviceClassName": DEVICE_CLASS, "count": count, **exactly}
    if capacity:
        body["capacity"] = {"requests": dict(capacity)}
    return {"devices": {"requests": [{"name": request, "exactly": body}]}}
