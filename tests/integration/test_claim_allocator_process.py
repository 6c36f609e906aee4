"""The extender process with ``--claim-allocator`` against the fake API server (issue #54): its webhook gates
a new pod that uses a claim of gpushared's class, and its leader allocates the claim and removes the gate;
a pod whose claims are another driver's is never gated."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator

import pytest

from gpushared.core.placement.admission import CLAIM_GATE
from tests.builders import admission_review
from tests.claimworld import allocation, claim, device, dra_node, gated_pod, gates
from tests.extender_harness import Extender
from tests.fakes.apiserver import FakeApiServer
from tests.harness import wait_until


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        dra_node(server, "n1", 16, 8)
        yield server


def test_the_webhook_gates_and_the_leader_allocates(api: FakeApiServer, spawn: Callable[..., Extender]) -> None:
    api.create(claim("small", memory="8Gi"))
    api.create(
        claim("nic", memory=None)
        | {"spec": {"devices": {"requests": [{"name": "n", "exactly": {"deviceClassName": "nic.example.com"}}]}}}
    )
    ext = spawn(api, args=["--claim-allocator", "--policy", "binpack"])
    ext.wait_ready()

    def patch_for(body: dict[str, object]) -> list[dict[str, object]]:
        status, answer = ext.post("mutate", admission_review(body))
        assert status == 200, answer
        raw = answer["response"].get("patch")
        return json.loads(base64.b64decode(raw)) if raw else []

    new = gated_pod("a", "small", gated=False)
    wait_until(lambda: bool(patch_for(new)), timeout=10, message="the webhook knows claim small")
    assert patch_for(new) == [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": CLAIM_GATE}]}]
    assert patch_for(gated_pod("b", "nic", gated=False)) == []  # another driver's claim: never gated
    api.create(gated_pod("a", "small"))  # as the API server stores it, the webhook's patch applied
    wait_until(lambda: not gates(api, "a"), timeout=10, message="the allocator removed the gate")
    assert allocation(api, "small") == [("n1", device(1), "8Gi")]
    metrics = ext.get("/metrics")[1].decode()
    assert 'gpushared_extender_claim_pods_total{outcome="allocated"} 1.0' in metrics
    assert "gpushared_extender_claim_gated_seconds_count 1.0" in metrics
    ext.stop()
