"""kube-scheduler's arithmetic for consumable device capacity (DRA, KEP-5075), as a pure model.

A device with ``allowMultipleAllocations`` is allocated to many claims, each consuming part of each of its
capacities. What one allocation consumes is the claim's request for that capacity (or the policy's
default, or the whole capacity where the device has no policy and the claim names none), rounded up by the
capacity's ``requestPolicy``:

- ``validValues``: the smallest valid value at or above the request; above them all, not allocatable;
- ``validRange``: at least ``min``; with ``step``, rounded up to ``min + n * step``; above ``max``, not
  allocatable.

An allocation fits when, for every capacity, what is already consumed plus what it consumes stays within
the capacity's value; a request for a capacity the device does not have fits no device. This is what the
upstream documentation of ``CapacityRequestPolicy`` and ``DeviceRequestAllocationResult.consumedCapacity``
says the scheduler does; the driver uses it to check the slices it publishes (tests/unit/test_dra_capacity.py
runs every sequence of claims against it) and to refuse, at prepare, a claim some other allocator put over
a GPU's capacity. Amounts are integers in the capacity's base unit (bytes for memory, percent for compute).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpushared.contract import ContractError
from gpushared.core.shared.quantity import parse_whole_quantity


@dataclass(frozen=True)
class RequestPolicy:
    """A capacity's ``requestPolicy``: ``default``, and either ``valid_values`` or a valid range."""

    default: int | None = None
    valid_values: tuple[int, ...] = ()
    min: int | None = None
    max: int | None = None
    step: int | None = None

    @property
    def ranged(self) -> bool:
        return self.min is not None


@dataclass(frozen=True)
class Capacity:
    value: int
    policy: RequestPolicy | None = None


@dataclass(frozen=True)
class ModelDevice:
    """A device as the scheduler sees it: its capacities, and whether many claims may share it."""

    name: str
    capacities: Mapping[str, Capacity] = field(default_factory=dict)
    shared: bool = False


def consumed(requested: int | None, capacity: Capacity) -> int | None:
    """What one allocation consumes of ``capacity`` for a request of ``requested`` (None: the claim names
    this capacity not); None when the request violates the policy."""
    policy = capacity.policy
    if policy is None:
        return capacity.value if requested is None else requested
    amount = requested
    if amount is None:
        amount = policy.default if policy.default is not None else capacity.value
    if policy.valid_values:
        at_least = [value for value in policy.valid_values if value >= amount]
        return min(at_least) if at_least else None
    if policy.ranged:
        low = policy.min or 0
        amount = max(amount, low)
        if policy.step:
            steps = -(-(amount - low) // policy.step)  # ceiling division
            amount = low + steps * policy.step
        if policy.max is not None and amount > policy.max:
            return None
    return amount


def consumption(device: ModelDevice, requests: Mapping[str, int]) -> dict[str, int] | None:
    """What an allocation of ``device`` consumes of each of its capacities for a claim's ``requests``;
    None when a request names a capacity the device lacks or violates a policy."""
    if any(name not in device.capacities for name in requests):
        return None
    result: dict[str, int] = {}
    for name, capacity in device.capacities.items():
        amount = consumed(requests.get(name), capacity)
        if amount is None:
            return None
        result[name] = amount
    return result


def fits(device: ModelDevice, used: Mapping[str, int], requests: Mapping[str, int]) -> dict[str, int] | None:
    """What the allocation consumes, if it fits beside ``used`` (what allocations already consume); else None.
    A device that is not shared fits one allocation only (``used`` non-empty: taken)."""
    if not device.shared and used:
        return None
    amounts = consumption(device, requests)
    if amounts is None:
        return None
    if device.shared and any(
        used.get(name, 0) + amount > device.capacities[name].value for name, amount in amounts.items()
    ):
        return None
    return amounts


# --- reading the published JSON ------------------------------------------------------------------------------


def model_device(body: Mapping[str, Any]) -> ModelDevice:
    """A ``resource.k8s.io/v1`` Device, as the scheduler would read it; :class:`ContractError` on bad text."""
    name = body.get("name")
    if not isinstance(name, str):
        raise ContractError(key="device.name", value=name, reason="expected a string")
    capacities: dict[str, Capacity] = {}
    for key, entry in (body.get("capacity") or {}).items():
        where = f"device {name} capacity {key}"
        if not isinstance(entry, Mapping):
            raise ContractError(key=where, value=entry, reason="expected an object")
        policy_body = entry.get("requestPolicy")
        policy = None
        if policy_body is not None:
            valid_range = policy_body.get("validRange") or {}
            policy = RequestPolicy(
                default=_optional(where, policy_body.get("default")),
                valid_values=tuple(parse_whole_quantity(where, v) for v in policy_body.get("validValues") or ()),
                min=_optional(where, valid_range.get("min")) if valid_range else None,
                max=_optional(where, valid_range.get("max")),
                step=_optional(where, valid_range.get("step")),
            )
        capacities[key] = Capacity(parse_whole_quantity(where, entry.get("value")), policy)
    return ModelDevice(name=name, capacities=capacities, shared=bool(body.get("allowMultipleAllocations")))


def _optional(where: str, value: object) -> int | None:
    return None if value is None else parse_whole_quantity(where, value)
