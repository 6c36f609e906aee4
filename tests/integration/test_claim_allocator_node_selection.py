"""The claim allocator places a pod's claims only on a node kube-scheduler would let the pod onto: its
``nodeSelector``, required node affinity and tolerations against the node's labels, taints and cordon. An
allocation on a node the pod can never go to holds the GPU's room for as long as the pod exists, and
kube-scheduler never binds the pod."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from gpushared.core.placement.claims.gate import CLAIM_GATE
from gpushared.core.placement.policies import BINPACK
from gpushared.extender.claims import placing as placing_module
from gpushared.extender.claims.allocator import AllocatorSettings
from tests.claimworld import ClaimWorld, allocation, claim, device, dra_node, gated_pod, gates
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.store import RESOURCES


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        dra_node(server, "n1", 16, 8)
        dra_node(server, "n2", 16)  # binpack's choice for 4 GiB: the fuller node
        node = server.get("nodes", "n1") or {}
        node["metadata"].setdefault("labels", {})["pool"] = "a"
        server.store.update(RESOURCES["nodes"], "", "n1", node, subresource="", precondition_rv=None)
        yield server


def with_spec(pod: dict[str, Any], **spec: Any) -> dict[str, Any]:
    pod["spec"].update(spec)
    return pod


def run(api: FakeApiServer, *pods: dict[str, Any], settle_steps: int = 0) -> ClaimWorld:
    world = ClaimWorld(api, AllocatorSettings(policy=BINPACK))

    async def main() -> None:
        await world.start()
        try:
            for number, pod in enumerate(pods):
                api.create(claim(f"c{number}", memory="4Gi"))
                api.create(pod)
            if settle_steps:
                for _ in range(settle_steps):
                    world.allocator.step()
                    await world.allocator.settle()
                    await asyncio.sleep(0.01)
            else:
                await world.until(lambda: all(not gates(api, p["metadata"]["name"]) for p in pods))
        finally:
            await world.stop()

    asyncio.run(main())
    return world


def test_a_node_selector_is_obeyed(api: FakeApiServer) -> None:
    run(api, gated_pod("free", "c0"), with_spec(gated_pod("a", "c1"), nodeSelector={"pool": "a"}))
    assert allocation(api, "c0") == [("n2", device(0), "4Gi")]  # the policy's choice, with no selection
    assert allocation(api, "c1") == [("n1", device(1), "4Gi")]


def test_required_node_affinity_is_obeyed(api: FakeApiServer) -> None:
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
    run(api, with_spec(gated_pod("a", "c0"), affinity=affinity))
    assert allocation(api, "c0") == [("n1", device(1), "4Gi")]


def test_a_taint_not_tolerated_keeps_the_pod_off(api: FakeApiServer) -> None:
    node = api.get("nodes", "n2") or {}
    node.setdefault("spec", {})["taints"] = [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]
    api.store.update(RESOURCES["nodes"], "", "n2", node, subresource="", precondition_rv=None)
    run(api, gated_pod("a", "c0"))
    assert allocation(api, "c0") == [("n1", device(1), "4Gi")]


def test_a_pod_no_node_admits_waits_gated_and_holds_nothing(api: FakeApiServer) -> None:
    world = run(api, with_spec(gated_pod("a", "c0"), nodeSelector={"no-such": "node"}), settle_steps=20)
    assert gates(api, "a") == [CLAIM_GATE]
    assert allocation(api, "c0") == []
    (told,) = world.allocator.told.values()
    assert "node selection" in told


def test_the_node_selections_kept_are_bounded_by_their_size(
    api: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's pods may each carry a large node selection of their own: the placer keeps at most
    MAX_SELECTION_BYTES of them, read again from the pods that still wait, and still decides each right."""
    monkeypatch.setattr(placing_module, "MAX_SELECTION_BYTES", 4000)
    pods = [
        with_spec(gated_pod(f"p{n}", f"c{n}"), nodeSelector={"pool": "none", f"k{n}": "x" * 500}) for n in range(20)
    ]
    pods.append(with_spec(gated_pod("a", "c20"), nodeSelector={"pool": "a"}))
    world = ClaimWorld(api, AllocatorSettings(policy=BINPACK))

    async def body(world: ClaimWorld) -> None:
        for number, pod in enumerate(pods):
            api.create(claim(f"c{number}", memory="4Gi"))
            api.create(pod)
        await world.until(lambda: not gates(api, "a"))
        for _ in range(5):
            world.allocator.step()
            await world.allocator.settle()
            assert world.allocator.placer._selection_bytes <= 4000

    world.run(body)
    assert allocation(api, "c20") == [("n1", device(1), "4Gi")]
    assert all(allocation(api, f"c{n}") == [] for n in range(20))
