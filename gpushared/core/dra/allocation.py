"""A claim's ``status.allocation`` as the claim allocator writes it: what kube-scheduler's own
allocator would write for the same devices, so that kube-scheduler, the kubelet and this driver read it as
theirs (``resource.k8s.io/v1`` ``AllocationResult``):

- ``devices.results``: one entry per device, ``{request, driver, pool, device}``, the pool being the node
  (one pool per node, ``core.dra.slices``); a device many claims share (``allowMultipleAllocations``) gets a
  ``shareID`` of its own per allocation and the ``consumedCapacity`` the claim takes of it, in the capacity's
  base unit: memory in bytes (whole units of the node, as the slice's ``validRange`` steps round a request),
  compute in percent;
- ``devices.config``: the DeviceClass's configuration for this driver (``source: FromClass``) before the
  claim's own (``FromClaim``), each for the requests it names: the order in which they apply
  (``core.dra.allocated`` reads them so, the claim's winning);
- ``nodeSelector``: the node, by ``metadata.name`` (a node-local pool): kube-scheduler's PreFilter keeps the
  pod to it, and the kubelet there prepares the claim;
- ``allocationTimestamp``: when it was allocated. kube-scheduler 1.36 (``DRADeviceBindingConditions`` and
  ``DRAResourceClaimDeviceStatus``, beta, on by default) sets it in PreBind on an allocation that lacks it,
  and the API server refuses that change (an allocation is immutable once written): written here, it is
  never changed, and kube-scheduler only adds the pod to ``reservedFor``. Older API servers drop the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushared.contract import dra
from gpushared.core.dra.slices import format_bytes


@dataclass(frozen=True)
class GivenDevice:
    """One device the allocator gives one request of a claim."""

    request: str
    device: str
    #: bytes of the GPU's memory the claim consumes
    memory: int
    #: percent of the GPU's compute the claim consumes
    compute: int
    #: this allocation's share of the device (a UUID, kube-scheduler's form)
    share_id: str


def allocation_body(
    *,
    node: str,
    devices: Sequence[GivenDevice],
    class_config: Sequence[Mapping[str, Any]] = (),
    claim_config: Sequence[Mapping[str, Any]] = (),
    driver: str = dra.DRIVER,
    allocated_at: str,
) -> dict[str, Any]:
    """The claim's ``status.allocation`` for ``devices`` on ``node``. ``class_config`` / ``claim_config``:
    the DeviceClass's ``spec.config`` and the claim's ``spec.devices.config`` entries, as written there;
    ``allocated_at``: the time, RFC 3339 in UTC to the second (``2026-01-02T03:04:05Z``, a ``metav1.Time``)."""
    results = [
        {
            "request": given.request,
            "driver": driver,
            "pool": node,
            "device": given.device,
            "shareID": given.share_id,
            "consumedCapacity": {
                dra.CAPACITY_MEMORY: format_bytes(given.memory),
                dra.CAPACITY_COMPUTE: str(given.compute),
            },
        }
        for given in devices
    ]
    config = [_config("FromClass", entry) for entry in class_config if _opaque_for(entry, driver)]
    config += [_config("FromClaim", entry) for entry in claim_config if _opaque_for(entry, driver)]
    devices_body: dict[str, Any] = {"results": results}
    if config:
        devices_body["config"] = config
    return {
        "devices": devices_body,
        "nodeSelector": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
        },
        "allocationTimestamp": allocated_at,
    }


def _opaque_for(entry: Mapping[str, Any], driver: str) -> bool:
    opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
    return isinstance(opaque, Mapping) and opaque.get("driver") == driver


def _config(source: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """One configuration entry as an allocation lists it, copied: for the requests it names (none: all)."""
    named = entry.get("requests")
    body: dict[str, Any] = {"source": source, "opaque": dict(entry["opaque"])}
    if isinstance(named, list) and named:
        body["requests"] = [str(name) for name in named]
    return body
