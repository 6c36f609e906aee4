"""What a real Kubernetes 1.36 cluster does to the claim allocator, taught to the fake API server and checked
here: a pod applied in one manifest with its claim reaches the webhook before the claim's watch event
reaches the allocator (watches lag); writing ``status.allocation`` needs ``resourceclaims/binding``
(KEP-4817); and kube-scheduler's PreBind sets ``allocationTimestamp`` on an allocation that lacks it, which
the API server refuses (an allocation is immutable). Each test fails against the allocator as it was before
it learned the difference."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpushared.core.placement.claims.gate import CLAIM_GATE, claim_gate
from gpushared.core.placement.policies import BINPACK
from gpushared.core.shared.bodies import PodBody
from gpushared.extender.claims.allocator import REFUSED_EVENT, SHOWN_WITHIN_SECONDS, AllocatorSettings
from gpushared.extender.claims.writes import REFUSED_RETRY_SECONDS
from tests.claimworld import (
    CLAIMS,
    ClaimWorld,
    FirstFitScheduler,
    allocation,
    claim,
    device,
    dra_node,
    gated_pod,
    gates,
)
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.patches import json_patch

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_RBAC = ROOT / "deploy" / "dra" / "claim-allocator.yaml"


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        assert server.version == (1, 36)
        dra_node(server, "n1", 16, 8)
        yield server


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def apply_rbac(api: FakeApiServer, *, without: str | None = None) -> str:
    """The shipped ClusterRole and its binding (less the rule for ``without``), and a token of the extender's
    ServiceAccount, whose requests the fake then checks against them."""
    for doc in yaml.safe_load_all(SHIPPED_RBAC.read_text()):
        if doc["kind"] == "ClusterRole" and without is not None:
            doc["rules"] = [r for r in doc["rules"] if without not in r["resources"]]
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            api.create(doc)
    api.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "gpushared-extender"}})
    return api.issue_token("kube-system", "gpushared-extender", seconds=3600)


def run(world: ClaimWorld, body: Any) -> None:
    world.run(body)


def test_the_shipped_rbac_lets_the_allocator_allocate_on_136(api: FakeApiServer) -> None:
    world = ClaimWorld(api, AllocatorSettings(policy=BINPACK), token=apply_rbac(api))

    async def body(world: ClaimWorld) -> None:
        api.create(claim("small", memory="8Gi"))
        api.create(gated_pod("a", "small"))
        await world.until(lambda: not gates(api, "a"))

    run(world, body)
    assert allocation(api, "small") == [("n1", device(1), "8Gi")]
    assert world.allocator.counts["refused"] == 0


def test_a_refused_permission_is_said_loudly_and_not_retried_every_step(api: FakeApiServer) -> None:
    """Without resourceclaims/binding every allocation is refused (422, Forbidden). The allocator counts it,
    tells the pod in a warning Event, names it in its readiness, and writes nothing more until
    REFUSED_RETRY_SECONDS have passed; granted the permission, its next try lands and the problem clears."""
    token = apply_rbac(api, without="resourceclaims/binding")
    clock = Clock()
    world = ClaimWorld(api, AllocatorSettings(policy=BINPACK), clock=clock, token=token)
    told: list[tuple[str, str]] = []

    async def event(pod: PodBody, reason: str, message: str) -> None:
        told.append((reason, message))

    def status_writes() -> int:
        return sum(1 for r in api.requests if r.method == "PUT" and r.path.endswith("/status"))

    async def body(world: ClaimWorld) -> None:
        world.allocator.event = event
        api.create(claim("small", memory="8Gi"))
        api.create(claim("other", memory="4Gi"))
        api.create(gated_pod("a", "small"))
        api.create(gated_pod("b", "other"))
        await world.until(lambda: world.allocator.counts["refused"] >= 1)
        written = status_writes()
        for _ in range(30):
            clock.now += 0.5  # 15 s: within the retry interval
            world.allocator.step()
            await world.allocator.settle()
            await asyncio.sleep(0.005)
        assert status_writes() == written, "retried within the interval"
        assert gates(api, "a") == gates(api, "b") == [CLAIM_GATE]
        refusals = world.allocator.writes.refusals
        assert refusals.why is not None and 'resource="resourceclaims/binding"' in refusals.why
        assert "resourceclaims/binding" in refusals.reason()
        refused_told = [message for reason, message in told if reason == REFUSED_EVENT]
        assert len(refused_told) == 2  # each pod told once, not at every step (a pod seen before its claim
        # may also have been told it waits for it)
        # The operator grants it: the next try, after the interval, lands.
        role = api.get("clusterroles", "gpushared-claim-allocator") or {}
        role["rules"].append(
            {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/binding"], "verbs": ["update"]}
        )
        api.store.update(
            api_resource("clusterroles"), "", role["metadata"]["name"], role, subresource="", precondition_rv=None
        )
        clock.now += REFUSED_RETRY_SECONDS
        await world.until(lambda: not gates(api, "a") and not gates(api, "b"))
        assert refusals.why is None

    run(world, body)
    # one refusal, or two where both pods were decided in one step before the first came back; nothing was
    # written after them within the interval (above)
    assert world.allocator.counts["refused"] in (1, 2) and world.allocator.counts["allocated"] == 2


def api_resource(plural: str) -> Any:
    from tests.fakes.store import RESOURCES

    return RESOURCES[plural]


def test_kube_scheduler_binds_a_pod_whose_claim_the_allocator_allocated(api: FakeApiServer) -> None:
    """kube-scheduler 1.36's PreBind adds the pod to reservedFor and an allocationTimestamp where the
    allocation has none; the API server refuses a changed allocation. The allocator writes the timestamp,
    so PreBind only reserves and the pod is bound."""
    scheduler = FirstFitScheduler(api)

    async def body(world: ClaimWorld) -> None:
        api.create(claim("small", memory="8Gi"))
        api.create(gated_pod("a", "small"))
        await world.until(lambda: not gates(api, "a"))
        await asyncio.to_thread(scheduler.bind_round)

    run(ClaimWorld(api, AllocatorSettings(policy=BINPACK)), body)
    assert scheduler.prebind_refused == [] and scheduler.bound == 1
    stored = api.get("resourceclaims", "small", "default") or {}
    assert stored["status"]["reservedFor"][0]["name"] == "a"
    assert stored["status"]["allocation"]["allocationTimestamp"].endswith("Z")
    assert (api.get("pods", "a", "default") or {})["spec"]["nodeName"] == "n1"


def test_the_fake_refuses_a_changed_allocation_as_136_does(api: FakeApiServer) -> None:
    """What the API server does to an allocation without a timestamp when PreBind adds one: refused."""
    api.create(claim("c"))
    body = api.get("resourceclaims", "c", "default") or {}
    rest = api.rest()
    allocated = {"devices": {"results": []}, "nodeSelector": {"nodeSelectorTerms": [{"matchFields": []}]}}
    rest.request("allocate", "PUT", f"{CLAIMS}/c/status", body={**body, "status": {"allocation": allocated}})
    body = api.get("resourceclaims", "c", "default") or {}
    stamped = {**body["status"]["allocation"], "allocationTimestamp": "2026-01-02T03:04:05Z"}
    with pytest.raises(Exception, match="field is immutable"):
        rest.request("prebind", "PUT", f"{CLAIMS}/c/status", body={**body, "status": {"allocation": stamped}})


def webhook(world: ClaimWorld, pod: dict[str, Any]) -> dict[str, Any]:
    """What the extender's /mutate does to a new pod with the allocator's view as it is now."""
    route = claim_gate(pod, ours=world.claim_cache.gating_of(pod, "default"))
    return json_patch(copy.deepcopy(pod), list(route.patch)) if route.patch else pod


def test_a_pod_applied_with_its_claim_is_gated_while_the_watch_lags(api: FakeApiServer) -> None:
    """A manifest applied whole: the claim is created, and its pod a moment later, before the claim's watch
    event reaches the allocator's claim_cache. The pod is gated, and allocated by the allocator once the claim is
    seen, not by kube-scheduler's first fit."""
    scheduler = FirstFitScheduler(api)

    async def body(world: ClaimWorld) -> None:
        api.watch_lag = 0.3
        api.create(claim("small", memory="8Gi"))
        api.create(webhook(world, gated_pod("a", "small", gated=False)))
        assert gates(api, "a") == [CLAIM_GATE]
        await asyncio.to_thread(scheduler.round)  # kube-scheduler sees nothing to allocate: the pod is gated
        await world.until(lambda: not gates(api, "a"))

    run(ClaimWorld(api, AllocatorSettings(policy=BINPACK)), body)
    assert scheduler.allocated == 0
    assert allocation(api, "small") == [("n1", device(1), "8Gi")]


def test_a_pod_of_another_driver_gated_while_unknown_is_let_go_at_once(api: FakeApiServer) -> None:
    """The cost of gating what is not known: a pod whose claim is another driver's is gated while the watch
    lags, and ungated as not ours at the allocator's first step that sees the claim, with no hand-over
    Event and without waiting for the allocator's writes to settle."""

    async def body(world: ClaimWorld) -> None:
        api.watch_lag = 0.3
        api.create(claim("nic", deviceClassName="nic.example.com"))
        api.create(webhook(world, gated_pod("a", "nic", gated=False)))
        assert gates(api, "a") == [CLAIM_GATE]
        world.allocator.last_write = world.allocator.clock()  # a write just now: a hand-over would wait 2 s
        await world.until(lambda: not gates(api, "a"), within=1.5)

    world = ClaimWorld(api, AllocatorSettings(policy=BINPACK))
    run(world, body)
    assert world.allocator.counts["not_ours"] == 1 and world.allocator.counts["handover"] == 0
    assert allocation(api, "nic") == []


def test_the_gate_goes_once_the_claim_watch_shows_the_allocation(api: FakeApiServer) -> None:
    """kube-scheduler told of an ungated pod before its claim watch shows the allocation allocates the claim
    itself, is refused (the claim is allocated), and tries the pod again seconds later: 0.5 % of gated pods on
    v1.36.2 before this. The allocator removes the gate only once its own claim watch shows what it wrote
    (kube-scheduler's shows it about as soon), or after SHOWN_WITHIN_SECONDS."""
    lag = 0.4
    ungated_after: list[float] = []

    async def body(world: ClaimWorld) -> None:
        api.create(claim("small", memory="8Gi"))
        api.create(gated_pod("a", "small"))
        await world.until(lambda: bool(world.claim_cache.claims.get("default", {}).get("small")))
        api.watch_lag = lag
        await world.until(lambda: not gates(api, "a"), within=5)
        ungated_after.append(time.monotonic() - world.allocator.last_write)

    run(ClaimWorld(api, AllocatorSettings(policy=BINPACK)), body)
    assert allocation(api, "small") == [("n1", device(1), "8Gi")]
    assert ungated_after[0] >= lag * 0.8, ungated_after
    assert ungated_after[0] < SHOWN_WITHIN_SECONDS + 0.5, ungated_after


def test_a_watch_that_shows_nothing_holds_the_gate_no_longer_than_its_bound(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld) -> None:
        api.create(claim("small", memory="8Gi"))
        api.create(gated_pod("a", "small"))
        await world.until(lambda: bool(world.claim_cache.claims.get("default", {}).get("small")))
        await asyncio.sleep(0.2)  # the pod seen too
        api.stall_watches()
        try:
            await world.until(lambda: not gates(api, "a"), within=SHOWN_WITHIN_SECONDS + 3)
        finally:
            api.stall_watches(False)

    run(ClaimWorld(api, AllocatorSettings(policy=BINPACK)), body)
    assert allocation(api, "small") == [("n1", device(1), "8Gi")]
