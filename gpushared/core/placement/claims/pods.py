"""A pod's DRA claims: the references in its ``spec.resourceClaims``, and what the claim allocator makes of
them once it holds the claims (the asks to allocate, the node an allocated claim fixes, or why it waits or
hands the pod over)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpushared.contract import dra
from gpushared.core.placement.claims.asks import ClaimAsk, Handover, asks_class, read_pending

#: The most claim references a pod may have (the API server allows 32 ``resourceClaims``).
MAX_POD_CLAIMS = 32


@dataclass(frozen=True)
class PodClaimRef:
    """One of a pod's ``spec.resourceClaims``: a claim by name, or the template a claim is made from. Two refs
    are the same when they name the same claim or template, whatever the pod calls them."""

    template: bool
    name: str
    #: the pod's own name for it (``spec.resourceClaims[].name``), "" where it gives none
    entry: str = field(default="", compare=False)


def pod_claims(pod: Mapping[str, Any]) -> list[PodClaimRef]:
    """The claims and claim templates a pod references, at most :data:`MAX_POD_CLAIMS`; entries that name
    neither are skipped (the API server refuses them). The one reader of ``spec.resourceClaims``."""
    found = []
    for entry in ((pod.get("spec") or {}).get("resourceClaims") or [])[:MAX_POD_CLAIMS]:
        if not isinstance(entry, Mapping):
            continue
        own = entry.get("name")
        for key, template in (("resourceClaimName", False), ("resourceClaimTemplateName", True)):
            name = entry.get(key)
            if isinstance(name, str) and name:
                found.append(PodClaimRef(template=template, name=name, entry=own if isinstance(own, str) else ""))
                break
    return found


@dataclass(frozen=True)
class PodClaims:
    """What the claim allocator makes of a gated pod's claims now: the asks to allocate (and the node an
    allocated claim of the pod fixes), or why the pod must wait, or be handed over to kube-scheduler."""

    asks: tuple[ClaimAsk, ...] = ()
    #: the node an already allocated claim of the pod is on: its other claims go there too
    node: str | None = None
    #: why nothing can be decided yet (a claim not created yet), or None
    waiting: str | None = None
    handover: Handover | None = None
    #: whether any of its claims asks for this driver's class; False: gated only because its claims were not
    #: known when it was created, and none is ours
    ours: bool = True


def claim_names(pod: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """(the pod's name for each claim, the ResourceClaim's name or None while the claim made from its
    template does not exist yet), at most :data:`MAX_POD_CLAIMS` entries; references the pod gives no name
    of its own are skipped (the API server refuses them)."""
    made = {
        entry.get("name"): entry.get("resourceClaimName")
        for entry in ((pod.get("status") or {}).get("resourceClaimStatuses") or [])[:MAX_POD_CLAIMS]
        if isinstance(entry, Mapping)
    }
    found: list[tuple[str, str | None]] = []
    for ref in pod_claims(pod):
        if not ref.entry:
            continue
        if not ref.template:
            found.append((ref.entry, ref.name))
            continue
        named = made.get(ref.entry)
        found.append((ref.entry, named if isinstance(named, str) and named else None))
    return found


def read_pod(
    pod: Mapping[str, Any], claims: Mapping[str, Mapping[str, Any]], *, device_class: str = dra.DEVICE_CLASS
) -> PodClaims:
    """The pod's claims (``claims``: the pod's namespace's claims by name) as the allocator acts on them.

    - a claim not created yet (from a template, or named and missing): wait;
    - a claim the allocator hands over, or a pending claim of another driver (the pod needs its node too,
      and only kube-scheduler allocates both together): hand the whole pod over, saying why;
    - claims of this driver allocated already on one node: the pending ones go there; on two nodes (only
      another allocator writes that), hand over;
    - nothing pending of this driver: nothing to allocate (the gate goes);
    - no claim of this driver's class at all: not ours (``ours`` False), the gate goes.
    """
    bodies: list[tuple[str, Mapping[str, Any]]] = []
    for pod_name, name in claim_names(pod):
        body = claims.get(name) if name is not None else None
        if body is None:
            return PodClaims(waiting=f"claim {name or pod_name} does not exist yet")
        bodies.append((str(name), body))
    if not any(asks_class(body, device_class) for _, body in bodies):
        return PodClaims(ours=False)
    asks: list[ClaimAsk] = []
    nodes: set[str] = set()
    for name, body in bodies:
        read = read_pending(body, device_class=device_class)
        if isinstance(read, Handover):
            return PodClaims(handover=Handover(f"claim {name}: {read.reason}"))
        if isinstance(read, ClaimAsk):
            asks.append(read)
            continue
        allocation = (body.get("status") or {}).get("allocation")
        if not allocation:
            return PodClaims(handover=Handover(f"claim {name} is for another driver's devices, pending too"))
        node = allocated_node(allocation)
        if node is not None:
            nodes.add(node)
    if len(nodes) > 1:
        return PodClaims(handover=Handover(f"its claims are allocated on nodes {', '.join(sorted(nodes))}"))
    return PodClaims(asks=tuple(asks), node=next(iter(nodes), None))


def allocated_node(allocation: object) -> str | None:
    """The one node an allocation's ``nodeSelector`` names by ``metadata.name`` (as kube-scheduler and this
    allocator write it for a node-local pool), or None."""
    if not isinstance(allocation, Mapping):
        return None
    selector = allocation.get("nodeSelector")
    terms = selector.get("nodeSelectorTerms") if isinstance(selector, Mapping) else None
    if not isinstance(terms, list) or len(terms) != 1 or not isinstance(terms[0], Mapping):
        return None
    for field_ in terms[0].get("matchFields") or []:
        if (
            isinstance(field_, Mapping)
            and field_.get("key") == "metadata.name"
            and field_.get("operator") == "In"
            and isinstance(field_.get("values"), list)
            and len(field_["values"]) == 1
            and isinstance(field_["values"][0], str)
        ):
            return str(field_["values"][0])
    return None
