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


def gate_operation(pod: PodBody, name: str) -> dict[str, Any] | None:
    """The JSON Patch operation that adds the scheduling gate ``name`` to a new pod; None if it holds it."""
    gates = (pod.get("spec") or {}).get("schedulingGates")
    if isinstance(gates, list) and any(isinstance(g, dict) and g.get("name") == name for g in gates):
        return None
    gate = {"name": name}
    if isinstance(gates, list):
        return {"op": "add", "path": "/spec/schedulingGates/-", "value": gate}
    return {"op": "add", "path": "/spec/schedulingGates", "value": [gate]}
