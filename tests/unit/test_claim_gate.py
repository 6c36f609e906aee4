"""The claim allocator's scheduling gate, as the webhook adds it to a new pod (``core.placement.claims.gate``):
a table of pods, what the allocator knows of their claims, and the patch and its reason."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gpushared.core.placement.claims.gate import CLAIM_GATE, claim_gate
from gpushared.core.placement.claims.pods import MAX_POD_CLAIMS, PodClaimRef, pod_claims
from tests.builders import pod
from tests.fakes.patches import json_patch

CLAIM = PodClaimRef(template=False, name="gpu")
TEMPLATE = PodClaimRef(template=True, name="gpu-tpl")
NIC = PodClaimRef(template=False, name="nic")


def with_claims(*entries: dict[str, Any], gates: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body = pod("p", 0)
    body["spec"]["resourceClaims"] = list(entries)
    if gates is not None:
        body["spec"]["schedulingGates"] = gates
    return body


def by_name(name: str) -> dict[str, Any]:
    return {"name": name, "resourceClaimName": name}


def by_template(name: str) -> dict[str, Any]:
    return {"name": "c", "resourceClaimTemplateName": name}


CASES: list[tuple[str, dict[str, Any], dict[PodClaimRef, bool | None], list[dict[str, Any]] | None, str]] = [
    (
        "our claim",
        with_claims(by_name("gpu")),
        {CLAIM: True},
        [{"name": CLAIM_GATE}],
        "claim gpu asks for gpushared's GPUs: gated for the claim allocator",
    ),
    (
        "our template",
        with_claims(by_template("gpu-tpl")),
        {TEMPLATE: True},
        [{"name": CLAIM_GATE}],
        "template gpu-tpl asks for gpushared's GPUs: gated for the claim allocator",
    ),
    (
        "ours beside another driver's",
        with_claims(by_name("nic"), by_name("gpu")),
        {CLAIM: True, NIC: False},
        [{"name": CLAIM_GATE}],
        "claim gpu asks for gpushared's GPUs: gated for the claim allocator",
    ),
    (
        "another gate kept",
        with_claims(by_name("gpu"), gates=[{"name": "x.example.com/quota"}]),
        {CLAIM: True},
        [{"name": "x.example.com/quota"}, {"name": CLAIM_GATE}],
        "claim gpu asks for gpushared's GPUs: gated for the claim allocator",
    ),
    ("gated already", with_claims(by_name("gpu"), gates=[{"name": CLAIM_GATE}]), {CLAIM: True}, None, "gated already"),
    ("only another driver's", with_claims(by_name("nic")), {NIC: False}, None, "no claim of ours"),
    ("no claims", with_claims(), {}, None, "no claim of ours"),
    (
        "a claim not known yet (applied with its pod)",
        with_claims(by_name("gpu")),
        {},
        [{"name": CLAIM_GATE}],
        "claims gpu not known yet: gated until the claim allocator reads them",
    ),
    (
        "a template not known yet",
        with_claims(by_template("gpu-tpl")),
        {TEMPLATE: None},
        [{"name": CLAIM_GATE}],
        "claims gpu-tpl not known yet: gated until the claim allocator reads them",
    ),
    (
        "another driver's known, one unknown",
        with_claims(by_name("nic"), by_name("gpu")),
        {NIC: False},
        [{"name": CLAIM_GATE}],
        "claims gpu not known yet: gated until the claim allocator reads them",
    ),
    ("an entry naming nothing", with_claims({"name": "c"}), {}, None, "no claim of ours"),
]


@pytest.mark.parametrize(("body", "ours", "gates", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_claim_gate(
    body: dict[str, Any], ours: dict[PodClaimRef, bool | None], gates: list[dict[str, Any]] | None, reason: str
) -> None:
    route = claim_gate(body, ours=ours)  # type: ignore[arg-type]
    assert route.reason == reason
    if gates is None:
        assert route.patch == ()
    else:
        patched = json_patch(copy.deepcopy(body), list(route.patch))
        assert patched["spec"]["schedulingGates"] == gates


def test_a_pods_references_are_bounded_and_typed() -> None:
    body = with_claims(*[by_name(f"c{i}") for i in range(100)], "junk", {"name": "x", "resourceClaimName": 7})  # type: ignore[arg-type]
    assert len(pod_claims(body)) == MAX_POD_CLAIMS  # type: ignore[arg-type]
    assert pod_claims(with_claims("junk", {"name": "x", "resourceClaimName": 7}, by_template("t"))) == [  # type: ignore[arg-type]
        PodClaimRef(template=True, name="t")
    ]
