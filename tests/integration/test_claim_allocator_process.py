"""The extender process with ``--claim-allocator`` against the fake API server (issue #54): its webhook gates
a new pod that uses a claim of gpushared's class, and its leader allocates the claim and removes the gate;
a pod whose claims are another driver's is never gated."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator

import pytest

from gpushared.core.placement.claims.gate import CLAIM_GATE
from gpushared.core.placement.steering import STEER_GATE
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
    # a claim the webhook does not know yet gates too (it may have been applied with its pod); once known to
    # be another driver's, it never does
    other = gated_pod("b", "nic", gated=False)
    wait_until(lambda: patch_for(other) == [], timeout=10, message="the webhook knows claim nic")
    assert patch_for(new) == [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": CLAIM_GATE}]}]
    assert ext.get("/readyz/claim-allocator")[0] == 200
    api.create(gated_pod("a", "small"))  # as the API server stores it, the webhook's patch applied
    wait_until(lambda: not gates(api, "a"), timeout=10, message="the allocator removed the gate")
    assert allocation(api, "small") == [("n1", device(1), "8Gi")]
    metrics = ext.get("/metrics")[1].decode()
    assert 'gpushared_extender_claim_pods_total{outcome="allocated"} 1.0' in metrics
    assert "gpushared_extender_claim_gated_seconds_count 1.0" in metrics
    ext.stop()


def test_steering_gates_cpu_only_pods_and_the_leader_steers_them(
    api: FakeApiServer, spawn: Callable[..., Extender]
) -> None:
    """``--steer-cpu-pods``: <prefix>/mutate-steer gates a new CPU-only pod (not one asking for GPUs), and the
    leader gives it a preferred node affinity and removes the gate; without the flag the route gates none."""
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "cpu-1"},
            "status": {"allocatable": {"cpu": "32", "memory": "64Gi"}},
        }
    )
    ext = spawn(api, args=["--claim-allocator", "--steer-cpu-pods", "--leader-elect", "--lease-seconds", "3"])
    ext.wait_ready()

    def patch_for(body: dict[str, object], route: str = "mutate-steer") -> list[dict[str, object]]:
        status, answer = ext.post(route, admission_review(body))
        assert status == 200, answer
        raw = answer["response"].get("patch")
        return json.loads(base64.b64decode(raw)) if raw else []

    web = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "1"}}}]},
    }
    wait_until(lambda: bool(patch_for(web)), timeout=10, message="the webhook gates once a leader holds the Lease")
    assert patch_for(web) == [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": STEER_GATE}]}]
    assert patch_for(gated_pod("a", "small", gated=False)) == []  # uses claims: the allocator's, not steered
    assert patch_for(web, route="mutate") == []  # the claim webhook's route never steers
    api.create({**web, "spec": {**web["spec"], "schedulingGates": [{"name": STEER_GATE}]}})
    wait_until(lambda: not gates(api, "web"), timeout=10, message="the leader steered the pod")
    stored = api.get("pods", "web", "default") or {}
    term = stored["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["preference"]["matchFields"][0]["values"] == ["cpu-1"]  # no GPU left idle beside it
    metrics = ext.get("/metrics")[1].decode()
    assert 'gpushared_extender_steered_pods_total{outcome="steered"} 1.0' in metrics
    ext.stop()
    plain = spawn(api, args=["--claim-allocator"])
    plain.wait_ready()
    status, answer = plain.post("mutate-steer", admission_review(web))
    assert status == 200 and not answer["response"].get("patch")
    plain.stop()
