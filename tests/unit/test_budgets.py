"""PodDisruptionBudgets as preemption reads them: which budgets select a pod, what each allows, and what a
budget that does not read comes to."""

from __future__ import annotations

from typing import Any

import pytest

from gpushared.core.placement.budgets import BudgetError, allowed_of, budgets_of, read_budget, selects


def budget(selector: Any, *, allowed: Any = 1, disrupted: Any = None, name: str = "b") -> dict[str, Any]:
    status: dict[str, Any] = {"disruptionsAllowed": allowed}
    if disrupted is not None:
        status["disruptedPods"] = disrupted
    return {"metadata": {"namespace": "ns", "name": name}, "spec": {"selector": selector}, "status": status}


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({"matchLabels": {"app": "nb"}}, {"app": "nb", "x": "y"}, True),
        ({"matchLabels": {"app": "nb"}}, {"app": "web"}, False),
        ({"matchLabels": {"app": "nb"}}, {}, False),
        ({}, {"app": "nb"}, False),  # an empty selector selects nothing, as kube-scheduler's preemption reads it
        (None, {"app": "nb"}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]}, {"tier": "b"}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]}, {}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]}, {}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]}, {"tier": "a"}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, {"tier": ""}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, {"tier": "a"}, False),
        (
            {"matchLabels": {"app": "nb"}, "matchExpressions": [{"key": "tier", "operator": "Exists"}]},
            {"app": "nb"},
            False,
        ),
    ],
)
def test_selects(selector: Any, labels: dict[str, str], expected: bool) -> None:
    assert selects(read_budget(budget(selector)), labels) is expected


def test_a_pod_counted_disrupted_already_is_not_counted_again() -> None:
    read = read_budget(budget({"matchLabels": {"app": "nb"}}, disrupted={"p1": "2026-11-29T00:00:00Z"}))
    assert budgets_of("p1", {"app": "nb"}, [read]) == ()
    assert budgets_of("p2", {"app": "nb"}, [read]) == ("ns/b",)


def test_allowed_by_key() -> None:
    one, two = (
        read_budget(budget({"matchLabels": {"a": "1"}}, allowed=0)),
        read_budget(budget({"matchLabels": {"a": "1"}}, allowed=3, name="c")),
    )
    assert allowed_of([one, two]) == {"ns/b": 0, "ns/c": 3}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (budget({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}), "operator 'Gt'"),
        (budget({"matchExpressions": [{"key": "a", "operator": "In", "values": "x"}]}), "not a list"),
        (budget({"matchLabels": {"a": 1}}), "not a string"),
        (budget({"matchLabels": {"a": "1"}}, allowed="2"), "disruptionsAllowed"),
        (budget({"matchLabels": {"a": "1"}}, allowed=True), "disruptionsAllowed"),
        (budget("app=nb"), "not an object"),
        ({"metadata": {}, "spec": {}}, "metadata.namespace"),
        (budget({"matchExpressions": [{"key": "a", "operator": "Exists"}] * 65}), "not a label selector"),
    ],
)
def test_a_budget_that_does_not_read_is_named(body: dict[str, Any], words: str) -> None:
    with pytest.raises(BudgetError, match=words.replace("(", r"\(")):
        read_budget(body)
