"""What the claim allocator makes of a gated pod's claims (``core.placement.claims.pods.read_pod``): each row a
pod, the claims its namespace holds, and what the allocator does: allocate, wait, or hand over (and why)."""

from __future__ import annotations

from typing import Any

import pytest

from gpushared.contract import dra
from gpushared.core.placement.claims.pods import PodClaims, allocated_node, claim_names, read_pod

FIELD = {"key": "metadata.name", "operator": "In"}


def claim(name: str, *, cls: str = dra.DEVICE_CLASS, node: str | None = None, **exactly: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"namespace": "ns", "name": name, "uid": f"u-{name}", "resourceVersion": "7"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": cls, **exactly}}]}},
    }
    if node is not None:
        body["status"] = {
            "allocation": {
                "devices": {"results": []},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            }
        }
    return body


def pod(*refs: dict[str, Any], statuses: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"namespace": "ns", "name": "p"}, "spec": {"resourceClaims": list(refs)}}
    if statuses is not None:
        body["status"] = {"resourceClaimStatuses": statuses}
    return body


def named(claim_name: str, as_: str = "c") -> dict[str, Any]:
    return {"name": as_, "resourceClaimName": claim_name}


def outcome(read: PodClaims) -> tuple[Any, ...]:
    return (
        [a.name for a in read.asks],
        read.node,
        read.waiting,
        None if read.handover is None else read.handover.reason,
    )


@pytest.mark.parametrize(
    ("refs", "claims", "expected"),
    [
        # one claim of ours, pending: allocate it
        ([named("a")], [claim("a")], (["a"], None, None, None)),
        # a claim not created yet: wait
        ([named("a")], [], ([], None, "claim a does not exist yet", None)),
        # ours allocated on n1 (shared with another pod) beside a pending one: the pending one goes to n1
        ([named("a", "x"), named("b", "y")], [claim("a", node="n1"), claim("b")], (["b"], "n1", None, None)),
        # all allocated: nothing to do (the gate goes)
        ([named("a")], [claim("a", node="n1")], ([], "n1", None, None)),
        # another driver's claim pending beside ours: only kube-scheduler allocates both together
        (
            [named("a", "x"), named("n", "y")],
            [claim("a"), claim("n", cls="nic.example.com")],
            ([], None, None, "claim n is for another driver's devices, pending too"),
        ),
        # another driver's claim allocated already: ours go to its node
        ([named("a", "x"), named("n", "y")], [claim("a"), claim("n", cls="nic", node="n2")], (["a"], "n2", None, None)),
        # claims on two nodes: only another allocator writes that
        (
            [named("a", "x"), named("b", "y")],
            [claim("a", node="n1"), claim("b", node="n2")],
            ([], None, None, "its claims are allocated on nodes n1, n2"),
        ),
        # CEL: handed over with the read's reason
        (
            [named("a")],
            [claim("a", selectors=[{"cel": {"expression": "true"}}])],
            ([], None, None, "claim a: request gpu has CEL selectors, which only kube-scheduler evaluates"),
        ),
    ],
)
def test_what_the_allocator_does_with_a_pods_claims(
    refs: list[dict[str, Any]], claims: list[dict[str, Any]], expected: tuple[Any, ...]
) -> None:
    assert outcome(read_pod(pod(*refs), {c["metadata"]["name"]: c for c in claims})) == expected


def test_a_template_claim_is_found_through_the_pods_status() -> None:
    template = {"name": "t", "resourceClaimTemplateName": "gpus"}
    assert claim_names(pod(template)) == [("t", None)]
    made = pod(template, statuses=[{"name": "t", "resourceClaimName": "p-t-1"}])
    assert claim_names(made) == [("t", "p-t-1")]
    assert outcome(read_pod(made, {"p-t-1": claim("p-t-1")})) == (["p-t-1"], None, None, None)
    assert outcome(read_pod(pod(template), {}))[2] == "claim t does not exist yet"


@pytest.mark.parametrize(
    "body",
    [
        None,
        "x",
        {"nodeSelector": None},
        {"nodeSelector": {"nodeSelectorTerms": []}},
        {"nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In"}]}]}},
        {"nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "x", "operator": "In", "values": ["n"]}]}]}},
        {"nodeSelector": {"nodeSelectorTerms": [{"matchFields": "bad"}]}},
    ],
)
def test_an_allocation_without_one_node_names_none(body: Any) -> None:
    assert allocated_node(body) is None


def test_malformed_pods_are_read_without_raising() -> None:
    assert claim_names({"spec": {"resourceClaims": ["x", {"name": 3}, {"name": "a"}]}}) == []
    assert (
        claim_names({"spec": {"resourceClaims": [{"name": "a", "resourceClaimName": "c"}] * 100}}) == [("a", "c")] * 32
    )


@pytest.mark.parametrize(
    ("claims", "ours", "waiting"),
    [
        # another driver's claim, pending or allocated: not ours, the gate goes at once
        ([claim("a", cls="nic.example.com")], False, None),
        ([claim("a", cls="nic.example.com", node="n1")], False, None),
        # ours, allocated: ours (nothing left to allocate)
        ([claim("a", node="n1")], True, None),
        # one of ours beside another driver's: ours
        ([claim("a", cls="nic.example.com", node="n1"), claim("b")], True, None),
        # a claim not made yet: nothing is known, the pod waits (it may be ours)
        ([claim("a", cls="nic.example.com")], True, "claim b does not exist yet"),
    ],
)
def test_a_pod_none_of_whose_claims_is_ours_is_told_apart(
    claims: list[dict[str, Any]], ours: bool, waiting: str | None
) -> None:
    """A pod gated because its claims were not known when it was created (the webhook gates those) is let go
    once they are known to be another driver's; one that still misses a claim waits."""
    refs = [named(c["metadata"]["name"], f"r{n}") for n, c in enumerate(claims)]
    if waiting is not None:
        refs.append(named("b", "missing"))
    read = read_pod(pod(*refs), {c["metadata"]["name"]: c for c in claims})
    assert (read.ours, read.waiting) == (ours, waiting)
