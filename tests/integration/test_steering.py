"""The steerer against the fake API server (issue #54): a gated CPU-only pod is read, given a preferred node
affinity for the nodes the extender's prioritize-no-gpu ranks best among those it may use, and ungated in one
JSON Patch that kube-apiserver's rule for gated pods accepts; DRA nodes priced by the claims on them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from gpushared.extender.steering import Steerer, idle_ledger
from tests.claimworld import ClaimWorld, claim, dra_node, gated_pod, gates, steered_pod
from tests.fakes.apiserver import FakeApiServer, Fault

PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def plain_node(api: FakeApiServer, name: str, *, taint: bool = False) -> None:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"pool": "cpu"}},
        "spec": {},
        "status": {"allocatable": {"cpu": "32", "memory": "128Gi"}},
    }
    if taint:
        body["spec"]["taints"] = [{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]
    api.create(body)


def preferred(api: FakeApiServer, name: str) -> list[tuple[int, list[str]]]:
    """The pod's preferred terms that name nodes: (weight, the nodes)."""
    body = api.get("pods", name, "default") or {}
    terms = (((body["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(PREFERRED)) or []
    return [
        (t["weight"], t["preference"]["matchFields"][0]["values"]) for t in terms if "matchFields" in t["preference"]
    ]


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        dra_node(server, "gpu-busy", 16, 16)
        yield server


def run(api: FakeApiServer, body: Callable[[ClaimWorld, Steerer], Awaitable[None]]) -> Steerer:
    world = ClaimWorld(api)
    found: list[Steerer] = []

    async def main() -> None:
        await world.start()
        steerer = Steerer(world.cache, world.aio, ledger_of=idle_ledger(world.cache, world.claim_cache))
        found.append(steerer)
        try:
            await body(world, steerer)
        finally:
            await steerer.settle()
            await world.stop()

    asyncio.run(main())
    return found[0]


async def steered(world: ClaimWorld, steerer: Steerer, api: FakeApiServer, pod: str) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while gates(api, pod):
        assert asyncio.get_running_loop().time() < deadline, f"pod {pod} still gated: {steerer.counts}"
        steerer.step()
        await steerer.settle()
        await asyncio.sleep(0.02)


async def busy(world: ClaimWorld, api: FakeApiServer) -> None:
    """12 GiB of gpu-busy's first GPU taken by a claim the allocator writes (the only DRA node yet)."""
    api.create(claim("taken", memory="12Gi"))
    api.create(gated_pod("holder", "taken"))
    await world.until(lambda: not gates(api, "holder"))


def test_a_cpu_only_pod_prefers_where_it_leaves_no_gpu_idle_and_skips_nodes_it_may_not_use(
    api: FakeApiServer,
) -> None:
    async def body(world: ClaimWorld, steerer: Steerer) -> None:
        await busy(world, api)
        dra_node(api, "gpu-idle", 16, 16)
        plain_node(api, "cpu-1")
        plain_node(api, "cpu-tainted", taint=True)
        api.create(steered_pod("web"))
        api.create(steered_pod("db", tolerations=[{"key": "dedicated", "operator": "Exists"}]))
        api.create(steered_pod("gpu-pool", nodeSelector={"gpushared": "x"}))  # no node has the label
        await asyncio.sleep(0.3)
        for pod in ("web", "db", "gpu-pool"):
            await steered(world, steerer, api, pod)

    steerer = run(api, body)
    # cpu-1 leaves no GPU idle; gpu-busy 20 GiB of gpu-idle's 32 (1 + 99 * 12 / 32); gpu-idle, the worst: unnamed
    assert preferred(api, "web") == [(100, ["cpu-1"]), (38, ["gpu-busy"])]
    assert preferred(api, "db") == [(100, ["cpu-1", "cpu-tainted"]), (38, ["gpu-busy"])]
    assert preferred(api, "gpu-pool") == []  # nowhere to go: only ungated
    assert steerer.counts == {"steered": 2, "unsteered": 1}
    assert len(steerer.latencies) == 3


def test_dra_nodes_are_priced_by_the_claims_on_them(api: FakeApiServer) -> None:
    """Only GPU nodes: the pod goes beside the GPU a claim uses (20 GiB left idle there, 32 on the idle
    node). Read from the gpu-mem ledgers, which hold no claims, the two nodes would tie."""

    async def body(world: ClaimWorld, steerer: Steerer) -> None:
        await busy(world, api)
        dra_node(api, "gpu-idle", 16, 16)
        api.create(
            steered_pod("web", affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}})
        )
        await asyncio.sleep(0.3)
        world.cache.inbox.drain()
        names = ["gpu-busy", "gpu-idle"]
        assert world.cache.index.idle_prices(names) == [32768.0, 32768.0]
        assert world.cache.index.idle_prices(names, ledger_of=idle_ledger(world.cache, world.claim_cache)) == [
            20480.0,
            32768.0,
        ]
        await steered(world, steerer, api, "web")

    run(api, body)
    assert preferred(api, "web") == [(100, ["gpu-busy"])]
    stored = api.get("pods", "web", "default") or {}
    assert "podAntiAffinity" in stored["spec"]["affinity"]


def test_a_pod_changed_between_the_read_and_the_patch_is_read_again(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld, steerer: Steerer) -> None:
        plain_node(api, "cpu-1")
        api.create(steered_pod("web"))
        await asyncio.sleep(0.3)
        world.cache.inbox.drain()
        # the patch made for the pod as read fails its resourceVersion test (the pod changed after the read:
        # kube-apiserver answers 422): the pod is read again and patched once more
        refused = api.inject(Fault(method="PATCH", path=r"pods/web$", status=422, message="testing value failed"))
        assert steerer.step() == 1
        await steerer.settle()
        assert refused.hits == 1 and not gates(api, "web")
        reads = [r for r in api.requests if r.method == "GET" and r.path.endswith("/pods/web")]
        assert len(reads) == 2

    steerer = run(api, body)
    assert preferred(api, "web") == [(100, ["cpu-1"])]
    assert steerer.counts["steered"] == 1


def test_a_burst_is_worked_through_a_bounded_number_at_a_time(api: FakeApiServer) -> None:
    async def body(world: ClaimWorld, steerer: Steerer) -> None:
        plain_node(api, "cpu-1")
        for n in range(80):
            api.create(steered_pod(f"p{n}"))
        await asyncio.sleep(0.5)
        world.cache.inbox.drain()
        assert steerer.step() == 32 and len(steerer.inflight) == 32
        await steerer.settle()
        for n in range(80):
            await steered(world, steerer, api, f"p{n}")

    steerer = run(api, body)
    assert steerer.counts["steered"] == 80
