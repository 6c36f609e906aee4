"""Steering CPU-only pods (``core.placement.steering``): which new pods the webhook gates, which nodes a gated
pod is given as its preference, and the one JSON Patch that adds it and removes the gate, applied to pods of
every affinity shape and checked against kube-apiserver's rule for gated pods (the fake API server's)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gpushared import contract
from gpushared.core.placement.claims.gate import CLAIM_GATE
from gpushared.core.placement.steering import (
    MAX_PREFERRED,
    STEER_GATE,
    Preferred,
    SteerCandidate,
    preferred_terms,
    steer_gate,
    steer_operations,
)
from tests.fakes.apiserver import ApiError
from tests.fakes.patches import PatchError, json_patch
from tests.fakes.store import _check_pod_spec_update

GPU_MEM = contract.DEFAULT_RESOURCES.gpu_mem


def pod(**spec: Any) -> dict[str, Any]:
    meta = spec.pop("metadata", {})
    body = {"containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}], **spec}
    return {"metadata": {"name": "p", "uid": "u1", "resourceVersion": "7", **meta}, "spec": body}


@pytest.mark.parametrize(
    ("spec", "gated", "reason"),
    [
        ({}, True, "asks for no GPU: gated to be steered off idle GPUs"),
        ({"schedulerName": "default-scheduler"}, True, "asks for no GPU: gated to be steered off idle GPUs"),
        ({"schedulingGates": [{"name": "other"}]}, True, "asks for no GPU: gated to be steered off idle GPUs"),
        ({"schedulingGates": [{"name": STEER_GATE}]}, False, "gated already"),
        ({"nodeName": "n1"}, False, "names its node"),
        ({"schedulerName": "volcano"}, False, "names scheduler 'volcano'"),
        (
            {"containers": [{"name": "c", "resources": {"limits": {GPU_MEM: "4"}}}]},
            False,
            "asks for GPU memory",
        ),
        ({"resourceClaims": [{"name": "g", "resourceClaimName": "c"}]}, False, "uses DRA claims"),
        (
            {"metadata": {"ownerReferences": [{"kind": "DaemonSet", "name": "ds"}]}},
            False,
            "a DaemonSet's pod: its node is chosen",
        ),
    ],
)
def test_which_new_pods_are_gated(spec: dict[str, Any], gated: bool, reason: str) -> None:
    body = pod(**spec)
    route = steer_gate(body, resources=contract.DEFAULT_RESOURCES)
    assert route.reason == reason
    assert bool(route.patch) is gated
    if gated:
        patched = json_patch(body, list(route.patch))
        assert {"name": STEER_GATE} in patched["spec"]["schedulingGates"]
        assert len(patched["spec"]["schedulingGates"]) == len(body["spec"].get("schedulingGates") or []) + 1


def c(name: str, idle: float) -> SteerCandidate:
    return SteerCandidate(name=name, idle=idle)


@pytest.mark.parametrize(
    ("candidates", "terms"),
    [
        ([], ()),
        ([c("a", 0)], ()),  # one node: nothing to choose
        ([c("a", 0), c("b", 0)], ()),  # the extender indifferent: no term
        ([c("a", 8192), c("b", 0), c("cpu", 0)], (Preferred(100, ("b", "cpu")),)),  # the worst are not named
        # graded as prioritize-no-gpu scores: 100 at the least idle, 1 toward the most, linear between
        ([c("a", 8192), c("b", 4096), c("c", 16384)], (Preferred(100, ("b",)), Preferred(67, ("a",)))),
        ([c("b", 4096), c("a", 4096), c("c", 16384)], (Preferred(100, ("a", "b")),)),  # one term per weight
        ([c("a", 16383), c("b", 0), c("c", 16384)], (Preferred(100, ("b",)), Preferred(1, ("a",)))),
    ],
)
def test_preferred_terms(candidates: list[SteerCandidate], terms: tuple[Preferred, ...]) -> None:
    assert preferred_terms(candidates) == terms


def test_past_the_most_named_kube_schedulers_scores_choose_at_the_cut_and_equal_ones_are_drawn() -> None:
    best = [c(f"b{i}", 0) for i in range(5)]
    tied = [c(f"n{i:03d}", 100) for i in range(40)]
    asked: list[str] = []

    def scores(name: str) -> float:
        asked.append(name)
        return float(int(name[1:]) % 3)

    everyone = [*best, *tied, c("busy", 8192)]
    terms = preferred_terms(everyone, kube_score=scores, shuffle=random.Random(1).shuffle)
    assert [t.weight for t in terms] == [100, 98]  # 1 + 99 * 8092 / 8192, rounded down
    assert terms[0].nodes == tuple(f"b{i}" for i in range(5))  # every node better than the cut is named
    chosen = terms[1].nodes
    assert len(chosen) == MAX_PREFERRED - 5
    assert sum(int(name[1:]) % 3 == 2 for name in chosen) == 13  # all 13 scoring 2 first, then 14 scoring 1
    assert sorted(set(asked)) == sorted(t.name for t in tied)  # scores asked only of the nodes at the cut
    other = preferred_terms(everyone, kube_score=scores, shuffle=random.Random(2).shuffle)
    assert set(other[1].nodes) != set(chosen)  # which of the equal ones: drawn, not the first names


TERM = {
    "weight": 100,
    "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1", "n2"]}]},
}
LIGHT = {
    "weight": 40,
    "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n3"]}]},
}
TERMS = (Preferred(100, ("n1", "n2")), Preferred(40, ("n3",)))
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
REQUIRED = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}
ANTI = {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "kubernetes.io/hostname"}]}


@pytest.mark.parametrize(
    ("affinity", "expected"),
    [
        (None, {"nodeAffinity": {PREFERRED: [TERM, LIGHT]}}),
        ({"podAntiAffinity": ANTI}, {"podAntiAffinity": ANTI, "nodeAffinity": {PREFERRED: [TERM, LIGHT]}}),
        (
            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": REQUIRED}},
            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": REQUIRED, PREFERRED: [TERM, LIGHT]}},
        ),
        (
            {"nodeAffinity": {PREFERRED: [{"weight": 5, "preference": {}}]}},
            {"nodeAffinity": {PREFERRED: [{"weight": 5, "preference": {}}, TERM, LIGHT]}},
        ),
    ],
)
def test_the_patch_adds_the_term_beside_what_the_pod_has_and_removes_the_gate(
    affinity: dict[str, Any] | None, expected: dict[str, Any]
) -> None:
    spec: dict[str, Any] = {"schedulingGates": [{"name": CLAIM_GATE}, {"name": STEER_GATE}]}
    if affinity is not None:
        spec["affinity"] = affinity
    body = pod(**spec)
    operations = steer_operations(body, TERMS)
    assert operations is not None
    patched = json_patch(body, operations)
    assert patched["spec"]["affinity"] == expected
    assert patched["spec"]["schedulingGates"] == [{"name": CLAIM_GATE}]
    _check_pod_spec_update(body["spec"], patched["spec"])  # kube-apiserver takes it: the pod was gated


def test_no_preferred_node_only_removes_the_gate_and_a_pod_without_it_gets_no_patch() -> None:
    body = pod(schedulingGates=[{"name": STEER_GATE}])
    operations = steer_operations(body, ())
    assert operations is not None
    assert json_patch(body, operations)["spec"] == {**body["spec"], "schedulingGates": []}
    assert steer_operations(pod(), TERMS) is None


def test_the_patch_applies_only_to_the_pod_as_read() -> None:
    body = pod(schedulingGates=[{"name": STEER_GATE}])
    operations = steer_operations(body, TERMS)
    assert operations is not None
    changed = {**body, "metadata": {**body["metadata"], "resourceVersion": "8"}}
    with pytest.raises(PatchError):
        json_patch(changed, operations)


def test_kube_apiserver_refuses_a_required_term_changed_on_a_gated_pod_and_any_affinity_on_an_ungated_one() -> None:
    gated = {"schedulingGates": [{"name": STEER_GATE}], "affinity": {"nodeAffinity": {PREFERRED: []}}}
    _check_pod_spec_update(gated, {**gated, "affinity": {"nodeAffinity": {PREFERRED: [TERM]}}})
    narrowed = {"nodeSelectorTerms": [{"matchExpressions": [*REQUIRED["nodeSelectorTerms"][0]["matchExpressions"]]}]}
    narrowed["nodeSelectorTerms"][0]["matchExpressions"].append({"key": "zone", "operator": "Exists"})
    with_required = {
        **gated,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": REQUIRED}},
    }
    _check_pod_spec_update(
        with_required,
        {**gated, "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": narrowed}}},
    )
    with pytest.raises(ApiError):
        _check_pod_spec_update(with_required, {**gated, "affinity": {"nodeAffinity": {}}})
    ungated = {"containers": []}
    with pytest.raises(ApiError):
        _check_pod_spec_update(ungated, {**ungated, "affinity": {"nodeAffinity": {PREFERRED: [TERM]}}})
