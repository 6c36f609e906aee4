"""The cluster's PodDisruptionBudgets, as the extender's cache shows them: which budgets select a pod, and how
many disruptions each allows now (``core.placement.budgets``), for preemption's choice of victims.

Fed by the cache's budget informer through its inbox and read on the event loop, like the rest of the cache.
A budget that does not read is left out and named in the log once.
"""

from __future__ import annotations

import logging
from typing import Any

from gpushared.core.placement.budgets import Budget, BudgetError, allowed_of, budgets_of, read_budget
from gpushared.core.shared.bodies import PodBody, key_of, meta_of

log = logging.getLogger(__name__)


class DisruptionBudgets:
    def __init__(self) -> None:
        #: namespace -> name -> budget
        self.budgets: dict[str, dict[str, Budget]] = {}
        #: budgets that did not read, named once
        self.problems: set[str] = set()
        self._allowed: dict[str, int] | None = None
        #: counts the changes: what is worked out from the budgets is kept until it moves
        self.version = 0

    def on_budget(self, old: Any, new: Any) -> None:
        self._allowed = None
        self.version += 1
        if old is not None:
            namespace, name = key_of(old)
            self.budgets.get(namespace, {}).pop(name, None)
            if not self.budgets.get(namespace, True):
                del self.budgets[namespace]
        if new is None:
            return
        try:
            budget = read_budget(new)
        except BudgetError as exc:
            if str(exc) not in self.problems:
                self.problems.add(str(exc))
                log.warning("PodDisruptionBudget left out of preemption's choice: %s", exc)
            return
        self.budgets.setdefault(budget.namespace, {})[budget.name] = budget

    def of(self, pod: PodBody) -> tuple[str, ...]:
        """The keys of the budgets that select the pod (its namespace's, by its labels)."""
        namespace, name = key_of(pod)
        budgets = self.budgets.get(namespace)
        if not budgets:
            return ()
        return budgets_of(name, meta_of(pod).get("labels") or {}, budgets.values())

    def allowed(self) -> dict[str, int]:
        """Budget key -> disruptions it allows now, worked out again only after a budget changed."""
        if self._allowed is None:
            self._allowed = allowed_of(b for budgets in self.budgets.values() for b in budgets.values())
        return self._allowed
