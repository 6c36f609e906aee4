"""Which of the driver's CDI devices a container is given together, so that each can tell it all their GPUs.

The runtime applies a container's CDI devices one after the other (containerd and CRI-O apply each device's
``containerEdits`` in turn) and a variable that two devices set keeps the value of the last: a container
with two claims, each naming its own GPU in ``NVIDIA_VISIBLE_DEVICES``, was told one GPU. Device nodes and
mounts add up; variables do not. So every device a container is given sets the variables they share
(``NVIDIA_VISIBLE_DEVICES``, Aliyun's ``ALIYUN_COM_GPU_MEM_*``) to one value, made from the GPUs of all of
them, and in whatever order they are applied the container is told every GPU of its claims
(``core.dra.prepare``).

A device's edits are the same for every container given it (the kubelet gives a claim's CDI devices to
every container that names the claim, or the request), so this holds when all the containers that use a
device are given the same devices: the device's **companions** (itself included). Containers that combine
a claim differently (one uses claims a and b, another a alone) cannot each be told their own GPUs by one
spec, and neither can a pod that combines a claim prepared earlier otherwise than the claim's spec was
written for: :func:`companions` says so for each such pod, and the driver refuses to prepare its claims,
never telling a container a GPU it does not hold. Pure.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from gpushared.core.dra.allocated import ClaimRef, cdi_name
from gpushared.core.dra.claimusers import container_claims, uses_request
from gpushared.core.shared.bodies import PodBody, key_of, uid_of

#: The CDI devices (``core.dra.allocated.cdi_name``) one container is given: its combination.
Combination = frozenset[str]


@dataclass(frozen=True)
class DriverClaim:
    """One of the driver's claims a container may name: prepared here, or being prepared."""

    ref: ClaimRef
    #: its requests with devices of this driver, as allocated (``a/b`` for a subrequest); None where the claim
    #: cannot be prepared now (unread, or refused), so that no claim used with it is prepared without it
    requests: tuple[str, ...] | None
    #: the companions each of its CDI devices was written for: a prepared claim's spec cannot change
    written: Mapping[str, Combination] = field(default_factory=dict)


@dataclass(frozen=True)
class Companions:
    #: each CDI device the pods' containers are given -> the devices given with it (itself included)
    of: dict[str, Combination]
    #: pod UID -> why its claims cannot be prepared, in words for the pod's events
    problems: dict[str, str]


def combinations(
    pod: PodBody, claims: Mapping[tuple[str, str], DriverClaim]
) -> Iterator[tuple[str, Combination, tuple[DriverClaim, ...]]]:
    """Each container of ``pod`` that names any of ``claims`` (by namespace and name): its name, the CDI
    devices it is given, and the claims it names that cannot be prepared now. Containers naming only other
    drivers' claims are not listed."""
    for container, _, uses in container_claims(pod):
        given: set[str] = set()
        unready: list[DriverClaim] = []
        for use in uses:
            claim = claims.get(use[:2])
            if claim is None:
                continue  # another driver's claim
            if claim.requests is None:
                unready.append(claim)
                continue
            given.update(cdi_name(claim.ref, r) for r in claim.requests if uses_request(use, r))
        if given or unready:
            yield str(container.get("name", "")), frozenset(given), tuple(unready)


def companions(
    pods: Iterable[PodBody], claims: Mapping[tuple[str, str], DriverClaim], *, mps: Collection[str] = ()
) -> Companions:
    """The companions of every CDI device that the containers of ``pods`` are given, and the pods whose
    containers cannot each be told their own GPUs: containers given one device with different companions,
    a container combining a prepared claim otherwise than its spec was written for, one naming a claim that
    cannot be prepared now beside others, or an MPS device (``mps``: CDI device names) with companions."""
    labels = _labels(claims.values())
    written = {name: combination for claim in claims.values() for name, combination in claim.written.items()}
    first: dict[str, tuple[Combination, str, str]] = {}  # device -> (combination, pod UID, where)
    problems: dict[str, str] = {}
    for pod in pods:
        uid = uid_of(pod)
        namespace, name = key_of(pod)
        for container, combination, unready in combinations(pod, claims):
            where = f"container {container} of pod {namespace}/{name}"
            said = _said(combination, labels)
            if unready and combination:
                problems.setdefault(
                    uid,
                    f"{where} uses claim {unready[0].ref.key} beside {said}, and it cannot be prepared now (its "
                    "own error says why): a claim used with others is prepared with them",
                )
            if len(combination) > 1 and any(device in mps for device in combination):
                problems.setdefault(
                    uid,
                    f"{where} uses {said}, one of them as an MPS client: an MPS client reaches one GPU's daemon "
                    "with one memory limit; give an MPS claim a container of its own",
                )
            for device in sorted(combination):
                before = written.get(device)
                if before is not None and before != combination:
                    problems.setdefault(
                        uid,
                        f"{where} uses {said}, but {labels.get(device, device)} was prepared for containers that "
                        f"use {_said(before, labels)} (its CDI spec is written): " + _ADVICE,
                    )
                seen = first.setdefault(device, (combination, uid, where))
                if seen[0] != combination:
                    clash = (
                        f"{seen[2]} uses {_said(seen[0], labels)} and {where} uses {said}: the CDI spec of "
                        f"{labels.get(device, device)} cannot tell each its own GPUs; " + _ADVICE
                    )
                    problems.setdefault(uid, clash)
                    problems.setdefault(seen[1], clash)
    return Companions(of={device: seen[0] for device, seen in first.items()}, problems=problems)


_ADVICE = "give every container that uses a claim the same claims, or each its own claim"


def _labels(claims: Iterable[DriverClaim]) -> dict[str, str]:
    """CDI device name -> the claim and request, as a person reads them."""
    labels: dict[str, str] = {}
    for claim in claims:
        for request in claim.requests or ():
            labels[cdi_name(claim.ref, request)] = f"{claim.ref.key} (request {request})"
    return labels


def _said(combination: Combination, labels: Mapping[str, str]) -> str:
    named = sorted(labels.get(device, device) for device in combination)
    if not named:
        return "no other claim of this driver"
    return "claim " + named[0] if len(named) == 1 else "claims " + ", ".join(named)
