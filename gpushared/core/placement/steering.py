"""Steering CPU-only pods where kube-scheduler calls no extender (issue #54, the claim allocator alone).

On a managed cluster kube-scheduler places pods that ask for no GPU by its own scores, which spread them
over every node: onto GPU nodes whose GPUs fgd keeps idle for the pods to come, whose CPU they then use up.
The replay measured it (docs/dra.md, "What the allocator places"): the allocator alone placed up to 11
points less than fgd. The extender's answer for such a pod is ``prioritize-no-gpu``: the nodes where it
leaves the least GPU memory idle beside it (``idle_gpu_mib``). Without the extender's verbs, the same answer
is given to kube-scheduler as a *preferred* node affinity on the pod:

1. the webhook gates a new CPU-only pod, in the namespaces an operator opted in (:func:`steer_gate`);
2. the leader works out the nodes the extender would rank best for it (:func:`preferred_nodes`) and, in one
   JSON Patch, adds a preferred term naming them and removes the gate (:func:`steer_operations`). A gated
   pod's node affinity may change (KEP-3838; kube-apiserver's ``validateNodeAffinityMutation`` constrains
   only the required terms); kube-scheduler's NodeAffinity score then gives those nodes its whole weight.

A preference never keeps a pod from running: kube-scheduler still filters, and a pod the preferred nodes
cannot take goes elsewhere. Where every node the pod may use is worth the same to the extender (a cluster
without idle GPUs, a pod kept to CPU nodes) no term is added: the gate only goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushared.contract import ResourceNames
from gpushared.core.placement.admission import DEFAULT_SCHEDULER, SchedulerRoute, asks_for_gpu
from gpushared.core.shared.bodies import PodBody

#: The scheduling gate the claim allocator's leader removes once it has steered a CPU-only pod.
STEER_GATE = "gpushared.io/steer"
#: The most nodes one preferred term names: the rest of the tied nodes are left to kube-scheduler's scores.
MOST_PREFERRED = 32
#: The term's weight (1-100). kube-scheduler normalizes NodeAffinity's score to 0-100 over the nodes it
#: scores, so with no other preferred term any weight gives the named nodes the plugin's whole score.
STEER_WEIGHT = 100


def steer_gate(pod: PodBody, *, resources: ResourceNames) -> SchedulerRoute:
    """Gate a new pod that asks for no GPU (no GPU memory or count, no DRA claim) and that kube-scheduler
    places; leave every other pod as it is."""
    spec: Any = pod.get("spec") or {}
    meta: Any = pod.get("metadata") or {}
    scheduler = spec.get("schedulerName") or ""
    if spec.get("nodeName"):
        return SchedulerRoute((), "names its node")
    if scheduler not in ("", DEFAULT_SCHEDULER):
        return SchedulerRoute((), f"names scheduler {scheduler!r}")
    if asks_for_gpu(pod, resources):
        return SchedulerRoute((), "asks for GPU memory")
    if spec.get("resourceClaims"):
        return SchedulerRoute((), "uses DRA claims")
    owners = meta.get("ownerReferences") or []
    if isinstance(owners, list) and any(isinstance(o, Mapping) and o.get("kind") == "DaemonSet" for o in owners):
        return SchedulerRoute((), "a DaemonSet's pod: its node is chosen")
    gates = spec.get("schedulingGates")
    if isinstance(gates, list) and any(isinstance(g, Mapping) and g.get("name") == STEER_GATE for g in gates):
        return SchedulerRoute((), "gated already")
    gate = {"name": STEER_GATE}
    patch = (
        {"op": "add", "path": "/spec/schedulingGates/-", "value": gate}
        if isinstance(gates, list)
        else {"op": "add", "path": "/spec/schedulingGates", "value": [gate]}
    )
    return SchedulerRoute((patch,), "asks for no GPU: gated to be steered off idle GPUs")


@dataclass(frozen=True)
class SteerCandidate:
    """A node the pod may go to, and the GPU memory it would leave idle beside the pod there: the extender's
    ``prioritize-no-gpu`` price (``idle_gpu_mib``), lower is better."""

    name: str
    idle: float


def preferred_nodes(
    candidates: Sequence[SteerCandidate],
    *,
    preference: Callable[[str], float] = lambda name: 0.0,
    most: int = MOST_PREFERRED,
    shuffle: Callable[[list[str]], None] = lambda tied: None,
) -> tuple[str, ...]:
    """The nodes to prefer: those the extender ranks best, or none when it ranks every candidate the same.
    Past ``most`` of them, those kube-scheduler's resource scores rank best (``preference``, asked only then;
    ``shuffle`` orders equal ones)."""
    if not candidates:
        return ()
    best = min(c.idle for c in candidates)
    tied = [c.name for c in candidates if c.idle == best]
    if len(tied) == len(candidates):
        return ()
    if len(tied) > most:
        shuffle(tied)
        tied.sort(key=lambda name: -preference(name))  # stable: equal scores keep the shuffled order
        tied = tied[:most]
    return tuple(sorted(tied))


def steer_operations(pod: PodBody, nodes: Sequence[str]) -> list[dict[str, Any]] | None:
    """The JSON Patch that adds a preferred term naming ``nodes`` (none: no term) and removes the gate, for
    the pod as read: it tests the pod's resourceVersion, so it applies only to that pod as it was (the
    affinity paths depend on what it holds). None: the pod holds no steering gate."""
    meta: Any = pod.get("metadata") or {}
    spec: Any = pod.get("spec") or {}
    gates = spec.get("schedulingGates") or []
    at = next((i for i, g in enumerate(gates) if isinstance(g, Mapping) and g.get("name") == STEER_GATE), None)
    if at is None:
        return None
    operations: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/uid", "value": meta.get("uid")},
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")},
    ]
    if nodes:
        operations.append(_preference(spec, list(nodes)))
    operations.append({"op": "remove", "path": f"/spec/schedulingGates/{at}"})
    return operations


def _preference(spec: Mapping[str, Any], nodes: list[str]) -> dict[str, Any]:
    """The one operation that adds the term, at the deepest part of the pod's affinity that exists."""
    term = {
        "weight": STEER_WEIGHT,
        "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": nodes}]},
    }
    affinity = spec.get("affinity")
    if not isinstance(affinity, Mapping):
        return {"op": "add", "path": "/spec/affinity", "value": {"nodeAffinity": {_PREFERRED: [term]}}}
    node_affinity = affinity.get("nodeAffinity")
    if not isinstance(node_affinity, Mapping):
        return {"op": "add", "path": "/spec/affinity/nodeAffinity", "value": {_PREFERRED: [term]}}
    if not isinstance(node_affinity.get(_PREFERRED), list):
        return {"op": "add", "path": f"/spec/affinity/nodeAffinity/{_PREFERRED}", "value": [term]}
    return {"op": "add", "path": f"/spec/affinity/nodeAffinity/{_PREFERRED}/-", "value": term}


_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
