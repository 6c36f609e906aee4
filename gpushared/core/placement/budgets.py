"""PodDisruptionBudgets, as preemption weighs them: which budgets select a pod, and how many disruptions each
allows now. Victims are chosen with the fewest budgets violated (``core.placement.preemption``), as
kube-scheduler chooses them; the Eviction API then refuses (429) what a budget forbids.

Read as kube-scheduler's preemption reads them (``filterPodsWithPDBViolation``):

- a budget selects the pods of its namespace whose labels its ``spec.selector`` matches; a budget with no
  selector, or an empty one, selects none;
- ``status.disruptionsAllowed`` is what it allows; a pod already in ``status.disruptedPods`` is not
  counted against it again.

Bounded: the API server caps a selector's size; a budget that does not read (a selector of an unknown
operator, a count that is not a number) is left out, logged by its reader, never a crash.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: The most match expressions and values read of one selector (a selector is small; a larger one is refused).
MAX_EXPRESSIONS = 64
MAX_VALUES = 256


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: frozenset[str]


@dataclass(frozen=True)
class Budget:
    """One PodDisruptionBudget as preemption reads it."""

    namespace: str
    name: str
    labels: tuple[tuple[str, str], ...]
    requirements: tuple[Requirement, ...]
    allowed: int
    #: pods it counts as disrupted already (by name)
    disrupted: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class BudgetError(ValueError):
    """A budget that cannot be read: named, and left out."""


def read_budget(body: Mapping[str, Any]) -> Budget:
    """The budget of a PodDisruptionBudget object (policy/v1 or v1beta1), or :class:`BudgetError`."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    namespace, name = meta.get("namespace"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise BudgetError("metadata.namespace and metadata.name must be strings")
    selector = spec.get("selector") or {}
    if not isinstance(selector, Mapping):
        raise BudgetError(f"{namespace}/{name}: spec.selector is not an object")
    labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not isinstance(labels, Mapping) or not isinstance(expressions, list) or len(expressions) > MAX_EXPRESSIONS:
        raise BudgetError(f"{namespace}/{name}: spec.selector is not a label selector")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise BudgetError(f"{namespace}/{name}: spec.selector.matchLabels holds a value that is not a string")
    requirements = tuple(_requirement(f"{namespace}/{name}", entry) for entry in expressions)
    allowed = status.get("disruptionsAllowed", 0)
    if not isinstance(allowed, int) or isinstance(allowed, bool):
        raise BudgetError(f"{namespace}/{name}: status.disruptionsAllowed is not a number")
    disrupted = status.get("disruptedPods") or {}
    return Budget(
        namespace=namespace,
        name=name,
        labels=tuple(sorted(labels.items())),
        requirements=requirements,
        allowed=allowed,
        disrupted=frozenset(k for k in disrupted if isinstance(k, str))
        if isinstance(disrupted, Mapping)
        else frozenset(),
    )


def _requirement(where: str, entry: object) -> Requirement:
    if not isinstance(entry, Mapping):
        raise BudgetError(f"{where}: a match expression is not an object")
    key, operator, values = entry.get("key"), entry.get("operator"), entry.get("values") or []
    if not isinstance(key, str) or operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
        raise BudgetError(f"{where}: match expression {key!r} has operator {operator!r}")
    if not isinstance(values, list) or len(values) > MAX_VALUES or not all(isinstance(v, str) for v in values):
        raise BudgetError(f"{where}: match expression {key!r} has values that are not a list of strings")
    return Requirement(key, str(operator), frozenset(values))


def selects(budget: Budget, labels: Mapping[str, str]) -> bool:
    """Whether the budget's selector matches the labels (an empty selector matches nothing, as kube-scheduler's
    preemption has it)."""
    if not budget.labels and not budget.requirements:
        return False
    if any(labels.get(key) != value for key, value in budget.labels):
        return False
    for requirement in budget.requirements:
        present = requirement.key in labels
        value = labels.get(requirement.key)
        if requirement.operator == "In" and (not present or value not in requirement.values):
            return False
        if requirement.operator == "NotIn" and present and value in requirement.values:
            return False
        if requirement.operator == "Exists" and not present:
            return False
        if requirement.operator == "DoesNotExist" and present:
            return False
    return True


def budgets_of(name: str, labels: Mapping[str, str], budgets: Iterable[Budget]) -> tuple[str, ...]:
    """The keys of the budgets (of the pod's namespace) that select pod ``name`` and count its disruption."""
    return tuple(sorted(b.key for b in budgets if name not in b.disrupted and selects(b, labels)))


def allowed_of(budgets: Iterable[Budget]) -> dict[str, int]:
    """Budget key -> the disruptions it allows now (what ``preemption.pdb_violations`` counts against)."""
    return {budget.key: budget.allowed for budget in budgets}
