"""The scheduling gate that holds a new pod back from kube-scheduler while the claim allocator places its
claims, and the webhook's decision to add it."""

from __future__ import annotations

from gpushared.core.placement.admission import SchedulerRoute, gate_operation
from gpushared.core.placement.claims.pods import PodClaimRef, pod_claims
from gpushared.core.shared.bodies import PodBody

#: The scheduling gate the claim allocator removes once it has allocated a pod's claims.
CLAIM_GATE = "gpushared.io/claim-allocator"


def claim_gate(pod: PodBody, *, ours: dict[PodClaimRef, bool | None]) -> SchedulerRoute:
    """Hold a new pod back from kube-scheduler while the claim allocator places its claims: a scheduling
    gate, added at creation (the only time one can be), when a claim or template it references asks for
    this driver's DeviceClass. ``ours`` says so for each reference: True, False, or None where the
    allocator's view does not hold it yet.

    A reference not known yet gates too. A manifest holding a claim and its pod, applied whole, reaches the
    webhook before the claim's watch event reaches the allocator's view, and a claim made from a template
    exists only after its pod: let through, such a pod would be allocated by kube-scheduler's first fit.
    Gated, it waits for the allocator to read its claims, which ungates it at once if none is ours (its
    cost, for a pod of another driver whose claim the view did not hold yet: the time to the allocator's
    next step). A pod every reference of which is known not to be ours is never gated."""
    refs = pod_claims(pod)
    mine = [ref for ref in refs if ours.get(ref)]
    unknown = [ref for ref in refs if ours.get(ref) is None]
    if not mine and not unknown:
        return SchedulerRoute((), "no claim of ours")
    patch = gate_operation(pod, CLAIM_GATE)
    if patch is None:
        return SchedulerRoute((), "gated already")
    if mine:
        kind = "template" if mine[0].template else "claim"
        return SchedulerRoute(
            (patch,), f"{kind} {mine[0].name} asks for gpushared's GPUs: gated for the claim allocator"
        )
    names = ", ".join(ref.name for ref in unknown)
    return SchedulerRoute((patch,), f"claims {names} not known yet: gated until the claim allocator reads them")
