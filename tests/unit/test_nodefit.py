"""Which nodes kube-scheduler's filters let a pod onto, by labels, taints and cordon (``core.placement.nodefit``),
worked out by hand from kube-scheduler's rules."""

from __future__ import annotations

from typing import Any

import pytest

from gpushared.core.placement.nodefit import MOST, NodeTraits, admits, facts_of, tolerates, within_bounds

GPU = NodeTraits(name="gpu-1", labels={"pool": "gpu", "gen": "9"})
TAINTED = NodeTraits(name="gpu-2", labels={"pool": "gpu"}, taints=(("nvidia.com/gpu", "present", "NoSchedule"),))
CORDONED = NodeTraits(name="cpu-1", labels={"pool": "cpu"}, unschedulable=True)


def pod(**spec: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "c"}], **spec}}


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, "values": list(values)}


@pytest.mark.parametrize(
    ("node", "spec", "fits"),
    [
        (GPU, {}, True),
        (GPU, {"nodeSelector": {"pool": "gpu"}}, True),
        (GPU, {"nodeSelector": {"pool": "cpu"}}, False),
        (GPU, {"nodeSelector": {"pool": "gpu", "zone": "a"}}, False),  # every pair must hold
        (GPU, {"affinity": required({"matchExpressions": [expr("pool", "In", "cpu", "gpu")]})}, True),
        (GPU, {"affinity": required({"matchExpressions": [expr("pool", "NotIn", "gpu")]})}, False),
        (GPU, {"affinity": required({"matchExpressions": [expr("zone", "NotIn", "a")]})}, True),  # absent: not in
        (GPU, {"affinity": required({"matchExpressions": [expr("zone", "Exists")]})}, False),
        (GPU, {"affinity": required({"matchExpressions": [expr("zone", "DoesNotExist")]})}, True),
        (GPU, {"affinity": required({"matchExpressions": [expr("gen", "Gt", "8")]})}, True),
        (GPU, {"affinity": required({"matchExpressions": [expr("gen", "Lt", "9")]})}, False),
        (GPU, {"affinity": required({"matchExpressions": [expr("gen", "Gt", "eight")]})}, False),  # not a number
        (GPU, {"affinity": required({"matchExpressions": [expr("pool", "Like", "gpu")]})}, False),  # unknown op
        # terms are alternatives; within one, every expression holds
        (
            GPU,
            {
                "affinity": required(
                    {"matchExpressions": [expr("pool", "In", "cpu")]}, {"matchExpressions": [expr("gen", "In", "9")]}
                )
            },
            True,
        ),
        (
            GPU,
            {"affinity": required({"matchExpressions": [expr("pool", "In", "gpu"), expr("gen", "In", "8")]})},
            False,
        ),
        (GPU, {"affinity": required({})}, False),  # an empty term matches no node
        (GPU, {"affinity": required()}, False),  # no term at all: none matches
        (GPU, {"affinity": required({"matchFields": [expr("metadata.name", "In", "gpu-1")]})}, True),
        (GPU, {"affinity": required({"matchFields": [expr("metadata.name", "NotIn", "gpu-1")]})}, False),
        (GPU, {"affinity": required({"matchFields": [expr("metadata.uid", "In", "gpu-1")]})}, False),
        # preferred terms never filter
        (
            GPU,
            {
                "affinity": {
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 1, "preference": {"matchExpressions": [expr("pool", "In", "cpu")]}}
                        ]
                    }
                }
            },
            True,
        ),
        # taints: tolerated by key and value, by Exists, by an empty key with Exists; effects must agree
        (TAINTED, {}, False),
        (TAINTED, {"tolerations": [{"key": "nvidia.com/gpu", "value": "present"}]}, True),
        (TAINTED, {"tolerations": [{"key": "nvidia.com/gpu", "value": "absent"}]}, False),
        (TAINTED, {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}, True),
        (TAINTED, {"tolerations": [{"operator": "Exists"}]}, True),
        (TAINTED, {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}]}, False),
        (TAINTED, {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}, True),
        (CORDONED, {}, False),
        (CORDONED, {"tolerations": [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]}, True),
        # malformed: never judged to fit
        (GPU, {"nodeSelector": ["pool"]}, False),
        (GPU, {"tolerations": "all"}, False),
        (GPU, {"tolerations": [{"operator": "Exists"}] * 65}, False),
        (GPU, {"affinity": required(*[{"matchExpressions": [expr("pool", "In", "gpu")]}] * 65)}, False),
    ],
)
def test_admits(node: NodeTraits, spec: dict[str, Any], fits: bool) -> None:
    assert admits(node, pod(**spec)) is fits


def test_facts_keep_only_taints_that_filter() -> None:
    body = {
        "metadata": {"name": "n", "labels": {"a": "1", "b": 2}},
        "spec": {
            "unschedulable": True,
            "taints": [
                {"key": "x", "value": "1", "effect": "NoSchedule"},
                {"key": "y", "effect": "PreferNoSchedule"},
                {"key": "z", "effect": "NoExecute"},
                "junk",
            ],
        },
    }
    assert facts_of(body) == NodeTraits(
        name="n", labels={"a": "1"}, taints=(("x", "1", "NoSchedule"), ("z", "", "NoExecute")), unschedulable=True
    )


def test_an_equal_toleration_without_a_key_matches_by_value_as_upstream() -> None:
    assert tolerates({"value": "v"}, ("any", "v", "NoSchedule"))
    assert not tolerates({"value": "w"}, ("any", "v", "NoSchedule"))
    assert not tolerates({"key": "k", "operator": "Sometimes"}, ("k", "", "NoSchedule"))


@pytest.mark.parametrize(
    ("spec", "whole"),
    [
        ({}, True),
        ({"tolerations": [{"operator": "Exists"}] * MOST}, True),
        ({"tolerations": [{"operator": "Exists"}] * (MOST + 1)}, False),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Exists"}]}]
                            * (MOST + 1)
                        }
                    }
                }
            },
            False,
        ),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "a", "operator": "Exists"}] * (MOST + 1)}
                            ]
                        }
                    }
                }
            },
            False,
        ),
    ],
)
def test_within_bounds_says_when_admits_read_the_selection_whole(spec: dict[str, Any], whole: bool) -> None:
    """Past the bounds ``admits`` says no: the claim allocator's fence, which must count every node
    kube-scheduler may place a pod on, counts such a pod as fitting anywhere instead."""
    assert within_bounds({"spec": spec}) is whole
