"""Whether kube-scheduler's filters let a pod onto a node, as far as the node's labels, taints and
``unschedulable`` decide it: the pod's ``nodeSelector``, its required node affinity, its tolerations.

The steering of CPU-only pods (``core.placement.steering``) prefers nodes by name; a node the pod cannot go
to would waste the preference (kube-scheduler filters it out, and the pod is placed as if unsteered), so
such nodes are never candidates. The rules are kube-scheduler's (``component-helpers/scheduling/corev1``:
``MatchNodeSelectorTerms``, ``TolerationsTolerateTaint``; the ``NodeUnschedulable`` plugin):

- ``nodeSelector``: every pair is one of the node's labels;
- required node affinity: its terms are alternatives; within a term every expression holds; a term with no
  expression matches no node; ``matchFields`` knows ``metadata.name`` only;
- taints with effect ``NoSchedule`` or ``NoExecute`` are each tolerated by one of the pod's tolerations
  (``PreferNoSchedule`` only scores); an ``unschedulable`` node takes only pods tolerating
  ``node.kubernetes.io/unschedulable:NoSchedule``.

Anything malformed (an unknown operator, a value that is not a number for ``Gt``) does not match: the API
server refuses such pods, and a node never wrongly counted as fitting is the safe side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpushared.core.shared.bodies import PodBody

#: The taint kube-scheduler treats ``spec.unschedulable`` as (``NodeUnschedulable``).
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
#: The effects that keep a pod off a node it does not tolerate.
FILTERING_EFFECTS = ("NoSchedule", "NoExecute")
#: The most expressions, terms or tolerations read from one pod (the API server bounds none of them by count;
#: a pod's size does): past these the pod is judged not to fit, never read without end.
MOST = 64


@dataclass(frozen=True)
class NodeTraits:
    """What of a node its fit for a pod depends on here."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    #: its taints with a filtering effect: (key, value, effect)
    taints: tuple[tuple[str, str, str], ...] = ()
    unschedulable: bool = False


def facts_of(node: Mapping[str, Any]) -> NodeTraits:
    """The node's facts from its body; what is not a string is left out."""
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if isinstance(k, str) and isinstance(v, str)}
    taints = tuple(
        (str(t.get("key") or ""), str(t.get("value") or ""), str(t.get("effect") or ""))
        for t in (spec.get("taints") or [])
        if isinstance(t, Mapping) and t.get("effect") in FILTERING_EFFECTS
    )
    return NodeTraits(
        name=str(meta.get("name") or ""), labels=labels, taints=taints, unschedulable=bool(spec.get("unschedulable"))
    )


def admits(node: NodeTraits, pod: PodBody) -> bool:
    """Whether the pod passes the node's labels, taints and cordon."""
    spec: Any = pod.get("spec") or {}
    selector = spec.get("nodeSelector") or {}
    if not isinstance(selector, Mapping) or any(node.labels.get(k) != v for k, v in selector.items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required is not None and not matches_terms(node, (required or {}).get("nodeSelectorTerms") or []):
        return False
    tolerations = spec.get("tolerations") or []
    if not isinstance(tolerations, list) or len(tolerations) > MOST:
        return False
    taints = list(node.taints)
    if node.unschedulable:
        taints.append((UNSCHEDULABLE_TAINT, "", "NoSchedule"))
    return all(any(tolerates(t, taint) for t in tolerations) for taint in taints)


def within_bounds(pod: PodBody) -> bool:
    """Whether ``admits`` reads the pod's node selection whole (at most :data:`MOST` tolerations, terms, and
    expressions in a term). Past them it judges the pod not to fit: the safe side where a node wrongly
    counted as fitting costs, the wrong side where one wrongly counted as not fitting does (the claim
    allocator's fence, which must count every node kube-scheduler may place a pod on)."""
    spec: Any = pod.get("spec") or {}
    tolerations = spec.get("tolerations") or []
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    terms = (required or {}).get("nodeSelectorTerms") or [] if isinstance(required, Mapping) else []
    if not isinstance(tolerations, list) or len(tolerations) > MOST or not isinstance(terms, list):
        return False
    if len(terms) > MOST:
        return False
    return all(
        not isinstance(term, Mapping)
        or len(term.get("matchExpressions") or []) + len(term.get("matchFields") or []) <= MOST
        for term in terms
    )


def matches_terms(node: NodeTraits, terms: Sequence[Any]) -> bool:
    """Whether any of the node selector terms matches the node (none: it matches no node)."""
    if not isinstance(terms, list) or len(terms) > MOST:
        return False
    return any(isinstance(term, Mapping) and _matches_term(node, term) for term in terms)


def _matches_term(node: NodeTraits, term: Mapping[str, Any]) -> bool:
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not isinstance(expressions, list) or not isinstance(fields, list):
        return False
    if (not expressions and not fields) or len(expressions) + len(fields) > MOST:
        return False
    labels_match = all(_holds(e, node.labels) for e in expressions)
    return labels_match and all(
        isinstance(f, Mapping) and f.get("key") == "metadata.name" and _holds(f, {"metadata.name": node.name})
        for f in fields
    )


def _holds(expression: Any, labels: Mapping[str, str]) -> bool:
    if not isinstance(expression, Mapping):
        return False
    key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
    if not isinstance(key, str) or not isinstance(values, list):
        return False
    value = labels.get(key)
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            have, bound = int(value), int(values[0])
        except (TypeError, ValueError):
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def tolerates(toleration: Any, taint: tuple[str, str, str]) -> bool:
    """A toleration tolerates a taint (``Toleration.ToleratesTaint``): the same effect or none named, the
    same key or none named with ``Exists``, and with ``Equal`` (the default) the same value."""
    if not isinstance(toleration, Mapping):
        return False
    key, value, effect = taint
    named_effect = toleration.get("effect") or ""
    if named_effect and named_effect != effect:
        return False
    named_key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if named_key and named_key != key:
        return False
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == value
