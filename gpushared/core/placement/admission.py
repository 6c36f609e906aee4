"""Which scheduler a new pod goes to, for clusters whose kube-scheduler cannot be configured.

On EKS, GKE and AKS the control plane's kube-scheduler takes no extender. gpushared then runs a second
kube-scheduler, ``gpushared-scheduler``, that calls the extender, and a mutating admission webhook (served
by the extender) sends the pods that ask for GPU memory to it: every other pod stays with the default
scheduler, which is left untouched. The decision is here, pure, and tested as a table; the extender's
HTTP route only unwraps the AdmissionReview and wraps the answer (docs/install.md, "Managed clusters").

The webhook never refuses a pod: it only rewrites ``spec.schedulerName``, and only from the default
scheduler. A pod that names another scheduler (Volcano, a batch scheduler) asked for it on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpushared.contract import ResourceNames
from gpushared.core.shared.bodies import PodBody

#: What the API server writes into ``spec.schedulerName`` when a pod names none.
DEFAULT_SCHEDULER = "default-scheduler"
#: The second scheduler's name, in deploy/managed/gpushared-scheduler.yaml and the extender's default.
GPUSHARED_SCHEDULER = "gpushared-scheduler"


@dataclass(frozen=True)
class SchedulerRoute:
    """The JSON Patch (RFC 6902) to apply to the pod, empty for none, and why: logged, and counted."""

    patch: tuple[dict[str, Any], ...]
    reason: str


def asks_for_gpu(pod: PodBody, resources: ResourceNames) -> bool:
    """Whether any container, init containers included, names GPU memory or a GPU count at all.

    Presence decides, not the amount: a malformed quantity is the extender's to refuse, with its precise
    reason in the pod's events, and it only can if the pod reaches the scheduler that calls it."""
    spec = pod.get("spec") or {}
    names = (resources.gpu_mem, resources.gpu_count)
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        needs = container.get("resources") or {}
        for part in (needs.get("limits") or {}, needs.get("requests") or {}):
            if any(name in part for name in names):
                return True
    return False


def scheduler_route(pod: PodBody, *, scheduler: str, resources: ResourceNames) -> SchedulerRoute:
    """Send a pod that asks for GPU memory to ``scheduler``; leave every other pod as it is."""
    spec = pod.get("spec") or {}
    current = spec.get("schedulerName") or ""
    if not asks_for_gpu(pod, resources):
        return SchedulerRoute((), "asks for no GPU")
    if current == scheduler:
        return SchedulerRoute((), f"already names {scheduler}")
    if current not in ("", DEFAULT_SCHEDULER):
        return SchedulerRoute((), f"names scheduler {current!r}, which is its choice")
    operation = "replace" if "schedulerName" in spec else "add"
    patch = ({"op": operation, "path": "/spec/schedulerName", "value": scheduler},)
    return SchedulerRoute(patch, f"asks for {resources.gpu_mem}: sent to {scheduler}")


#: The scheduling gate the claim allocator removes once it has allocated a pod's claims (issue #54).
CLAIM_GATE = "gpushared.io/claim-allocator"
#: The most claim references a pod may have (the API server allows 32 ``resourceClaims``).
MAX_POD_CLAIMS = 32


@dataclass(frozen=True)
class ClaimRef:
    """One of a pod's ``spec.resourceClaims``: a claim by name, or the template a claim is made from."""

    template: bool
    name: str


def pod_claims(pod: PodBody) -> list[ClaimRef]:
    """The claims and claim templates a pod references, at most :data:`MAX_POD_CLAIMS`; entries that name
    neither are skipped (the API server refuses them)."""
    found = []
    for entry in ((pod.get("spec") or {}).get("resourceClaims") or [])[:MAX_POD_CLAIMS]:
        if not isinstance(entry, dict):
            continue
        for key, template in (("resourceClaimName", False), ("resourceClaimTemplateName", True)):
            name = entry.get(key)
            if isinstance(name, str) and name:
                found.append(ClaimRef(template=template, name=name))
                break
    return found


def gate_operation(pod: PodBody, name: str) -> dict[str, Any] | None:
    """The JSON Patch operation that adds the scheduling gate ``name`` to a new pod; None if it holds it."""
    gates = (pod.get("spec") or {}).get("schedulingGates")
    if isinstance(gates, list) and any(isinstance(g, dict) and g.get("name") == name for g in gates):
        return None
    gate = {"name": name}
    if isinstance(gates, list):
        return {"op": "add", "path": "/spec/schedulingGates/-", "value": gate}
    return {"op": "add", "path": "/spec/schedulingGates", "value": [gate]}


def claim_gate(pod: PodBody, *, ours: dict[ClaimRef, bool | None]) -> SchedulerRoute:
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
