"""The fake API server's side of DRA (``resource.k8s.io/v1``): what kube-apiserver checks on a ResourceSlice,
and what kube-scheduler writes into a ResourceClaim when it allocates one.

The allocator is the scheduler's consumable-capacity arithmetic (``core.dra.capacity``) over the slices in the
store: for each request of a claim, the first devices of a node's slices (newest pool generation) that match
the request's class's driver and fit beside every allocated claim; ``status.allocation`` then names them
with ``consumedCapacity`` and a ``shareID``, as the scheduler writes it. Enough for the node daemon's side of
the protocol; CEL selectors and constraints are not evaluated here (the e2e cases on a real >= 1.34 cluster
run them: tests/e2e/test_dra.py).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from gpushared.contract import ContractError
from gpushared.core.dra.capacity import fits, model_device
from gpushared.core.shared.quantity import parse_whole_quantity

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class Invalid(ValueError):
    """What kube-apiserver answers 422 for."""


def validate_slice(body: dict[str, Any]) -> None:
    """A subset of kube-apiserver's ResourceSlice validation, the part a driver most easily gets wrong."""
    spec = body.get("spec") or {}
    pool = spec.get("pool") or {}
    if not spec.get("driver") or not pool.get("name"):
        raise Invalid("spec.driver, spec.pool.name: Required value")
    for key in ("generation", "resourceSliceCount"):
        if not isinstance(pool.get(key), int) or pool[key] < (1 if key == "resourceSliceCount" else 0):
            raise Invalid(f"spec.pool.{key}: Invalid value: {pool.get(key)!r}")
    devices = spec.get("devices") or []
    if len(devices) > 128:
        raise Invalid(f"spec.devices: Too many: {len(devices)}: must have at most 128 items")
    names = [d.get("name") for d in devices]
    if len(set(names)) != len(names):
        raise Invalid("spec.devices: Duplicate value")
    for number, device in enumerate(devices):
        where = f"spec.devices[{number}]"
        name = device.get("name")
        if not isinstance(name, str) or len(name) > 63 or not _LABEL.fullmatch(name):
            raise Invalid(f"{where}.name: Invalid value: {name!r}: a lowercase RFC 1123 label must ...")
        if len(device.get("attributes") or {}) + len(device.get("capacity") or {}) > 32:
            raise Invalid(f"{where}: Too many: attributes and capacities must have at most 32 items")
        for key, attribute in (device.get("attributes") or {}).items():
            if len(attribute) != 1 or next(iter(attribute)) not in ("int", "bool", "string", "version"):
                raise Invalid(f"{where}.attributes[{key}]: Invalid value: exactly one value must be specified")
            value = next(iter(attribute.values()))
            if isinstance(value, str) and len(value) > 64:
                raise Invalid(f"{where}.attributes[{key}]: Too long: may not be more than 64 bytes")
        try:
            _validate_capacities(where, device)
        except ContractError as exc:
            raise Invalid(f"{where}.capacity: Invalid value: {exc}") from None


def _validate_capacities(where: str, device: dict[str, Any]) -> None:
    model = model_device(device)
    for key, capacity in model.capacities.items():
        policy = capacity.policy
        if policy is None:
            continue
        if not model.shared:
            raise Invalid(f"{where}.capacity[{key}].requestPolicy: Forbidden: allowMultipleAllocations must be true")
        if policy.default is None:
            raise Invalid(f"{where}.capacity[{key}].requestPolicy.default: Required value")
        if policy.min is not None:
            high = capacity.value if policy.max is None else policy.max
            if not policy.min <= policy.default <= high or high > capacity.value:
                raise Invalid(f"{where}.capacity[{key}].requestPolicy: Invalid value: default outside validRange")
            if policy.step is not None and (
                (policy.default - policy.min) % policy.step
                or policy.min + policy.step > capacity.value
                or (policy.max is not None and (policy.max - policy.min) % policy.step)
            ):
                raise Invalid(f"{where}.capacity[{key}].requestPolicy.validRange.step: Invalid value")


def allocate(
    claim: dict[str, Any],
    *,
    slices: list[dict[str, Any]],
    claims: list[dict[str, Any]],
    classes: dict[str, str],
    node: str,
) -> dict[str, Any]:
    """``status.allocation`` for ``claim`` on ``node``; :class:`Invalid` when it does not fit ("cannot
    allocate all claims"). ``classes``: device class name -> the driver its selector names."""
    used: dict[tuple[str, str, str], dict[str, int]] = {}
    for other in claims:
        for result in (((other.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            key = (result["driver"], result["pool"], result["device"])
            for name, amount in (result.get("consumedCapacity") or {}).items():
                used.setdefault(key, {})[name] = used.get(key, {}).get(name, 0) + parse_whole_quantity(name, amount)
            used.setdefault(key, {})
    newest: dict[tuple[str, str], int] = {}
    for body in slices:
        spec = body["spec"]
        pool = (spec["driver"], spec["pool"]["name"])
        newest[pool] = max(newest.get(pool, 0), spec["pool"]["generation"])
    results = []
    for request in (claim.get("spec") or {}).get("devices", {}).get("requests") or []:
        exactly = request.get("exactly") or {}
        driver = classes.get(exactly.get("deviceClassName", ""))
        wanted = {
            k: parse_whole_quantity(k, v) for k, v in ((exactly.get("capacity") or {}).get("requests") or {}).items()
        }
        for _ in range(int(exactly.get("count") or 1)):
            chosen = None
            for body in slices:
                spec = body["spec"]
                if spec["driver"] != driver or spec.get("nodeName") != node:
                    continue
                if spec["pool"]["generation"] != newest[(spec["driver"], spec["pool"]["name"])]:
                    continue
                for device_body in spec.get("devices") or []:
                    key = (spec["driver"], spec["pool"]["name"], device_body["name"])
                    if any(r["device"] == key[2] and r["pool"] == key[1] for r in results) and not device_body.get(
                        "allowMultipleAllocations"
                    ):
                        continue
                    amounts = fits(model_device(device_body), used.get(key, {}), wanted)
                    if amounts is None:
                        continue
                    chosen = (key, amounts, bool(device_body.get("allowMultipleAllocations")))
                    break
                if chosen is not None:
                    break
            if chosen is None:
                raise Invalid(
                    f"cannot allocate all claims: request {request.get('name')!r} does not fit on node {node}"
                )
            (driver_name, pool_name, device_name), amounts, shared = chosen
            current = used.setdefault(chosen[0], {})
            for name, amount in amounts.items():
                current[name] = current.get(name, 0) + amount
            result: dict[str, Any] = {
                "request": request["name"],
                "driver": driver_name,
                "pool": pool_name,
                "device": device_name,
            }
            if shared:
                result["shareID"] = str(uuid.uuid4())
                result["consumedCapacity"] = {k: str(v) for k, v in amounts.items()}
            results.append(result)
    config = [
        {"source": "FromClaim", "requests": entry.get("requests") or [], "opaque": entry["opaque"]}
        for entry in (claim.get("spec") or {}).get("devices", {}).get("config") or []
        if "opaque" in entry
    ]
    return {
        "devices": {"results": results, "config": config},
        "nodeSelector": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
        },
    }


def check_claim_status_update(name: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    """kube-apiserver's invariants of a ResourceClaim's status (``validateResourceClaimStatusUpdate``): an
    allocation, once written, is immutable (it may only be removed), and reservations need an allocation."""
    invalid = f'ResourceClaim.resource.k8s.io "{name}" is invalid'
    if old.get("allocation") and new.get("allocation") and old["allocation"] != new["allocation"]:
        raise Invalid(f"{invalid}: status.allocation: Invalid value: {{...}}: field is immutable")
    if new.get("reservedFor") and not new.get("allocation"):
        raise Invalid(f"{invalid}: status.reservedFor: Forbidden: may not be specified when `allocated` is not set")
