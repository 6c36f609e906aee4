"""Steering CPU-only pods where kube-scheduler calls no extender (a cluster that runs the claim
allocator alone).

On a managed cluster kube-scheduler places pods that ask for no GPU by its own scores, which spread them
over every node: onto GPU nodes whose GPUs fgd keeps idle for the pods to come, whose CPU they then use up.
The replay measured it (docs/dra.md, "What the allocator places"): the allocator alone placed up to 11
points less than fgd. The extender's answer for such a pod is ``prioritize-no-gpu``: the nodes where it
leaves the least GPU memory idle beside it (``idle_gpu_mib``). Without the extender's verbs, the same answer
is given to kube-scheduler as a *preferred* node affinity on the pod:

1. the webhook gates a new CPU-only pod, in the namespaces an operator opted in (:func:`steer_gate`);
2. the leader works out the nodes the extender would rank best for it, weighted as it scores them
   (:func:`preferred_terms`), and in one JSON Patch adds preferred terms naming them and removes the gate
   (:func:`steer_operations`). A gated pod's node affinity may change (KEP-3838; kube-apiserver's
   ``validateNodeAffinityMutation`` constrains only the required terms); kube-scheduler's NodeAffinity
   score (weight 2 among its default scores) then ranks those nodes as the extender would.

A preference never keeps a pod from running: kube-scheduler still filters, and a pod the preferred nodes
cannot take goes elsewhere. Where every node the pod may use is worth the same to the extender (a cluster
without idle GPUs, a pod kept to CPU nodes) no term is added: the gate only goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushared.contract import ResourceNames
from gpushared.core.placement.admission import DEFAULT_SCHEDULER, SchedulerRoute, asks_for_gpu, gate_operation
from gpushared.core.shared.bodies import PodBody

#: The scheduling gate the claim allocator's leader removes once it has steered a CPU-only pod.
STEER_GATE = "gpushared.io/steer"
#: The most nodes the preferred terms name, all together: the rest are left to kube-scheduler's scores.
MAX_PREFERRED = 32
#: The heaviest term's weight (weights are 1-100). kube-scheduler normalizes NodeAffinity's score to 0-100
#: over the nodes it scores, so the best of them named gets the plugin's whole score.
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
    patch = gate_operation(pod, STEER_GATE)
    if patch is None:
        return SchedulerRoute((), "gated already")
    return SchedulerRoute((patch,), "asks for no GPU: gated to be steered off idle GPUs")


@dataclass(frozen=True)
class SteerCandidate:
    """A node the pod may go to, and the GPU memory it would leave idle beside the pod there: the extender's
    ``prioritize-no-gpu`` price (``idle_gpu_mib``), lower is better."""

    name: str
    idle: float


@dataclass(frozen=True)
class Preferred:
    """One preferred term: the nodes it names, and its weight (1-100)."""

    weight: int
    nodes: tuple[str, ...]


def preferred_terms(
    candidates: Sequence[SteerCandidate],
    *,
    kube_score: Callable[[str], float] = lambda name: 0.0,
    most: int = MAX_PREFERRED,
    shuffle: Callable[[list[str]], None] = lambda tied: None,
) -> tuple[Preferred, ...]:
    """The terms to add, heaviest first: the ``most`` nodes the extender ranks best, each weighted as
    ``prioritize-no-gpu`` scores it (100 for the least idle GPU memory, down to 1 toward the most), nodes of
    one weight in one term; none when every candidate is worth the same. Where the cut falls among nodes
    worth the same, kube-scheduler's resource scores choose (``kube_score``, asked only then; ``shuffle``
    orders equal ones). Graded rather than only the best: kube-scheduler scores only some of the feasible
    nodes of a large cluster (``percentageOfNodesToScore``), and among those it scores the term still says
    which are better."""
    if not candidates:
        return ()
    best, worst = min(c.idle for c in candidates), max(c.idle for c in candidates)
    if best == worst:
        return ()
    ranked = sorted((c for c in candidates if c.idle < worst), key=lambda c: c.idle)
    if len(ranked) > most:
        cut = ranked[most - 1].idle
        inside = [c for c in ranked if c.idle < cut]
        at_cut = [c.name for c in ranked if c.idle == cut]
        shuffle(at_cut)
        at_cut.sort(key=lambda name: -kube_score(name))  # stable: equal scores keep the shuffled order
        chosen = [(c.name, c.idle) for c in inside] + [(name, cut) for name in at_cut[: most - len(inside)]]
    else:
        chosen = [(c.name, c.idle) for c in ranked]
    by_weight: dict[int, list[str]] = {}
    for name, idle in chosen:
        weight = max(1, min(STEER_WEIGHT, 1 + int((STEER_WEIGHT - 1) * (worst - idle) / (worst - best))))
        by_weight.setdefault(weight, []).append(name)
    return tuple(Preferred(w, tuple(sorted(names))) for w, names in sorted(by_weight.items(), reverse=True))


def steer_operations(pod: PodBody, terms: Sequence[Preferred]) -> list[dict[str, Any]] | None:
    """The JSON Patch that adds the preferred ``terms`` (none: no term) and removes the gate, for the pod as
    read: it tests the pod's resourceVersion, so it applies only to that pod as it was (the affinity paths
    depend on what it holds). None: the pod holds no steering gate."""
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
    if terms:
        operations.extend(_preferences(spec, [_term(t) for t in terms]))
    operations.append({"op": "remove", "path": f"/spec/schedulingGates/{at}"})
    return operations


def _term(term: Preferred) -> dict[str, Any]:
    match = [{"key": "metadata.name", "operator": "In", "values": list(term.nodes)}]
    return {"weight": term.weight, "preference": {"matchFields": match}}


def _preferences(spec: Mapping[str, Any], terms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operations that add the terms, at the deepest part of the pod's affinity that exists."""
    affinity = spec.get("affinity")
    if not isinstance(affinity, Mapping):
        return [{"op": "add", "path": "/spec/affinity", "value": {"nodeAffinity": {_PREFERRED: terms}}}]
    node_affinity = affinity.get("nodeAffinity")
    if not isinstance(node_affinity, Mapping):
        return [{"op": "add", "path": "/spec/affinity/nodeAffinity", "value": {_PREFERRED: terms}}]
    if not isinstance(node_affinity.get(_PREFERRED), list):
        return [{"op": "add", "path": f"/spec/affinity/nodeAffinity/{_PREFERRED}", "value": terms}]
    return [{"op": "add", "path": f"/spec/affinity/nodeAffinity/{_PREFERRED}/-", "value": term} for term in terms]


_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
