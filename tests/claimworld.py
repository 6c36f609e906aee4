"""The claim allocator against the fake API server: nodes that publish their GPUs as ResourceSlices, claims,
gated pods, and the extender's cache and the allocator's claim cache fed by real informers, on one event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gpushared import contract
from gpushared.contract import dra
from gpushared.core.dra.slices import slice_body, slice_devices
from gpushared.core.placement.claims.gate import CLAIM_GATE
from gpushared.core.placement.policies import BINPACK
from gpushared.core.placement.steering import STEER_GATE
from gpushared.extender.cache import ClusterCache
from gpushared.extender.claims.allocator import AllocatorSettings, ClaimAllocator, claim_events
from gpushared.extender.claims.cache import ClaimCache
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.api import Api
from tests.builders import inventory
from tests.extender_harness import gpu_node
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.store import RESOURCES

GI = 2**30
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def dra_node(api: FakeApiServer, name: str, *sizes: int, cpu: str = "64", memory: str = "256Gi") -> None:
    """A node whose daemon runs in DRA mode: its inventory annotation and its ResourceSlice."""
    inv = inventory(*sizes)
    body = gpu_node(name, *sizes, inv=inv)
    body["status"]["allocatable"] = {"cpu": cpu, "memory": memory}
    api.create(body)
    api.create(slice_body(node=name, node_uid=None, generation=1, devices=slice_devices(inv)))


def claim(
    name: str, *, memory: str | None = "4Gi", compute: str | None = None, count: int = 1, **exactly: Any
) -> dict[str, Any]:
    wanted = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": dra.claim_spec(count=count, capacity=wanted, **exactly),
    }


def gated_pod(
    name: str,
    *claims: str,
    gated: bool = True,
    template: str | None = None,
    priority: int | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    refs: list[dict[str, Any]] = [{"name": f"c{n}", "resourceClaimName": c} for n, c in enumerate(claims)]
    if template is not None:
        refs.append({"name": "t", "resourceClaimTemplateName": template})
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
        "resourceClaims": refs,
    }
    if gated:
        spec["schedulingGates"] = [{"name": CLAIM_GATE}]
    if priority is not None:  # as the API server resolves it from the pod's PriorityClass
        spec["priority"] = priority
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def steered_pod(name: str, *, cpu: str = "2", **spec: Any) -> dict[str, Any]:
    """A CPU-only pod as the steering webhook leaves it: gated for the steerer."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}],
            "schedulingGates": [{"name": STEER_GATE}],
            **spec,
        },
    }


def allocation(api: FakeApiServer, name: str) -> list[tuple[str, str, str]]:
    """(node, device, memory consumed) of each device of the claim's allocation, as stored."""
    body = api.get("resourceclaims", name, "default") or {}
    results = ((body.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    return [(r["pool"], r["device"], r.get("consumedCapacity", {}).get("memory", "")) for r in results]


def gates(api: FakeApiServer, pod: str) -> list[str]:
    body = api.get("pods", pod, "default") or {}
    return [g["name"] for g in (body.get("spec") or {}).get("schedulingGates") or []]


def device(index: int) -> str:
    return dra.device_name(f"GPU-{index:08x}-0000-0000-0000-000000000000")


@dataclass
class ClaimWorld:
    """One allocator (a replica) with its own cache and claim_cache, on the caller's loop."""

    api: FakeApiServer
    settings: AllocatorSettings = field(default_factory=lambda: AllocatorSettings(policy=BINPACK))
    clock: Callable[[], float] = time.monotonic
    #: the allocator's writes authenticate with it (``FakeApiServer.issue_token``: RBAC checked); None: admin
    token: str | None = None

    async def start(self) -> ClaimAllocator:
        loop = asyncio.get_running_loop()
        rest = self.api.rest()
        self.cache = cache = ClusterCache(
            list_nodes=rest.lister("/api/v1/nodes", what="nodes"),
            list_pods=rest.lister("/api/v1/pods", what="pods"),
            list_budgets=rest.lister("/apis/policy/v1/poddisruptionbudgets", what="poddisruptionbudgets"),
            resources=contract.DEFAULT_RESOURCES,
            watch_seconds=5,
        )
        cache.owner.claim()
        cache.inbox.attach(loop)
        self.claim_cache = claim_cache = ClaimCache()
        claim_cache.watch(rest, cache.owner, watch_seconds=5)
        cache.start()
        claim_cache.start(loop)
        while not (cache.listed() and claim_cache.listed()):
            await asyncio.sleep(0.01)
        cache.prepare()
        self.aio = AsyncApi(self.api.credentials(token=self.token))
        events = claim_events(Api(self.api.rest(token=self.token)))
        self.allocator = ClaimAllocator(cache, claim_cache, self.aio, self.settings, clock=self.clock, event=events)
        return self.allocator

    async def until(self, done: Callable[[], bool], *, within: float = 10.0) -> None:
        """Step the allocator until ``done``; fail after ``within`` seconds (a hang is a failure)."""
        deadline = time.monotonic() + within
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not done within {within} s: {self.allocator.counts}, {self.allocator.told}")
            self.allocator.step()
            await self.allocator.settle()
            await asyncio.sleep(0.02)

    def run(self, body: Callable[[ClaimWorld], Awaitable[None]]) -> ClaimWorld:
        """Start the allocator on a new event loop, run ``body`` with it, stop it (also when ``body`` fails)."""

        async def main() -> None:
            await self.start()
            try:
                await body(self)
            finally:
                await self.stop()

        asyncio.run(main())
        return self

    async def stop(self) -> None:
        await self.allocator.settle()
        self.cache.stop()
        self.claim_cache.stop()
        await self.aio.close()


class FirstFitScheduler:
    """kube-scheduler's own DRA allocation, as far as the invariant needs it: for each pod that has no gate
    and pending claims of this driver, each claim is allocated first fit over the slices' devices with
    kube-scheduler's consumable-capacity arithmetic (``core.dra.capacity``), counting every allocation the
    API server holds, read afresh each round; its status writes are resourceVersion-guarded, as the
    scheduler's are."""

    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.rest = api.rest()
        self.allocated = 0
        #: pods bound after PreBind reserved their claims; PreBind writes the API server refused
        self.bound = 0
        self.prebind_refused: list[str] = []

    def bind_round(self) -> None:
        """kube-scheduler's PreBind and Bind for each ungated, unbound pod whose claims are all allocated: each
        claim gets the pod in ``reservedFor``, and from 1.36 (``DRADeviceBindingConditions`` with
        ``DRAResourceClaimDeviceStatus``, both on by default) an ``allocationTimestamp`` where the allocation
        lacks one, in one status write per claim; then the pod is bound to the allocation's node. A write the
        API server refuses leaves the pod unbound (kube-scheduler tries it again later)."""
        claims = {
            c["metadata"]["name"]: c
            for c in self.rest.request("list", "GET", "/apis/resource.k8s.io/v1/resourceclaims")["items"]
        }
        for pod in self.rest.request("list", "GET", "/api/v1/pods")["items"]:
            if pod["spec"].get("schedulingGates") or pod["spec"].get("nodeName"):
                continue
            mine = [claims.get(ref.get("resourceClaimName")) for ref in pod["spec"].get("resourceClaims") or []]
            if not mine or any(c is None or not (c.get("status") or {}).get("allocation") for c in mine):
                continue
            node = ""
            for body in mine:
                assert body is not None
                node = body["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]
                node = node["values"][0]
                if not self._reserve(body, pod):
                    break
            else:
                binding = {"target": {"kind": "Node", "name": node}, "metadata": {"name": pod["metadata"]["name"]}}
                path = f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}/binding"
                self.rest.request("bind", "POST", path, body=binding)
                self.bound += 1

    def _reserve(self, body: dict[str, Any], pod: dict[str, Any]) -> bool:
        status = dict(body.get("status") or {})
        meta = pod["metadata"]
        reserved = [r for r in status.get("reservedFor") or [] if r.get("uid") != meta["uid"]]
        status["reservedFor"] = [*reserved, {"resource": "pods", "name": meta["name"], "uid": meta["uid"]}]
        if self.api.version >= (1, 36) and "allocationTimestamp" not in status["allocation"]:
            status["allocation"] = {**status["allocation"], "allocationTimestamp": "2026-01-02T03:04:05Z"}
        try:
            self.rest.request(
                "reserve", "PUT", f"{CLAIMS}/{body['metadata']['name']}/status", body={**body, "status": status}
            )
        except Exception as exc:
            self.prebind_refused.append(str(exc))
            return False
        return True

    def round(self) -> None:
        claims = self.rest.request("list", "GET", "/apis/resource.k8s.io/v1/resourceclaims")["items"]
        slices = self.rest.request("list", "GET", "/apis/resource.k8s.io/v1/resourceslices")["items"]
        pods = self.rest.request("list", "GET", "/api/v1/pods")["items"]
        by_name = {c["metadata"]["name"]: c for c in claims}
        used = consumed_per_device(claims)
        for pod in pods:
            if pod["spec"].get("schedulingGates") or pod["spec"].get("nodeName"):
                continue
            for ref in pod["spec"].get("resourceClaims") or []:
                body = by_name.get(ref.get("resourceClaimName"))
                if body is None or (body.get("status") or {}).get("allocation"):
                    continue
                self._first_fit(body, slices, used)

    def _first_fit(self, body: dict[str, Any], slices: list[dict[str, Any]], used: dict[Any, dict[str, int]]) -> None:
        from gpushared.core.dra import capacity

        request = body["spec"]["devices"]["requests"][0]
        wanted = {k: parse(v) for k, v in ((request["exactly"].get("capacity") or {}).get("requests") or {}).items()}
        for published in slices:
            node = published["spec"]["nodeName"]
            for entry in published["spec"]["devices"]:
                model = capacity.model_device(entry)
                taken = capacity.fits(model, used.get((node, model.name), {}), wanted)
                if taken is None:
                    continue
                result = {
                    "request": "gpu",
                    "driver": dra.DRIVER,
                    "pool": node,
                    "device": model.name,
                    "shareID": "00000000-0000-4000-8000-000000000001",
                    "consumedCapacity": {k: str(v) for k, v in taken.items()},
                }
                selector = {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                }
                status = {"allocation": {"devices": {"results": [result]}, "nodeSelector": selector}}
                path = f"{CLAIMS}/{body['metadata']['name']}/status"
                try:
                    self.rest.request("allocate", "PUT", path, body={**body, "status": status})
                except Exception:
                    return
                self.allocated += 1
                return


class ClaimController:
    """kube-controller-manager's resourceclaim controller and the kubelet, as far as a claim's end needs them:
    a pod being deleted is stopped (deleted for good), its claims drop it from ``reservedFor``, and a claim
    reserved for no pod any more has its allocation cleared and the finalizer removed, but only where it
    carries ``dra.ALLOCATED_FINALIZER`` (the real controller leaves any other claim allocated)."""

    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.rest = api.rest()

    def stop_terminating(self) -> None:
        for pod in self.api.objects("pods"):
            if pod["metadata"].get("deletionTimestamp") is not None:
                self.api.store.delete(RESOURCES["pods"], "default", pod["metadata"]["name"], {"gracePeriodSeconds": 0})

    def round(self) -> None:
        alive = {p["metadata"]["uid"] for p in self.api.objects("pods")}
        for body in self.api.objects("resourceclaims"):
            status = dict(body.get("status") or {})
            reserved = status.get("reservedFor") or []
            remaining = [r for r in reserved if r.get("uid") in alive]
            if len(remaining) == len(reserved):
                continue
            status["reservedFor"] = remaining
            protected = dra.ALLOCATED_FINALIZER in (body["metadata"].get("finalizers") or [])
            if not remaining and protected:
                status.pop("allocation", None)
            name = body["metadata"]["name"]
            written = self.rest.request("unreserve", "PUT", f"{CLAIMS}/{name}/status", body={**body, "status": status})
            if protected and not remaining:
                meta = dict(written["metadata"])
                meta["finalizers"] = [f for f in meta.get("finalizers") or [] if f != dra.ALLOCATED_FINALIZER]
                self.rest.request("unprotect", "PUT", f"{CLAIMS}/{name}", body={**written, "metadata": meta})


def parse(value: object) -> int:
    from gpushared.core.shared.quantity import parse_whole_quantity

    return parse_whole_quantity("capacity", value)


def consumed_per_device(claims: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, int]]:
    """(node, device) -> what the claims the API server holds consume of each capacity."""
    used: dict[tuple[str, str], dict[str, int]] = {}
    for body in claims:
        allocation_ = (body.get("status") or {}).get("allocation") or {}
        for result in (allocation_.get("devices") or {}).get("results") or []:
            counted = used.setdefault((result["pool"], result["device"]), {})
            for name, amount in (result.get("consumedCapacity") or {}).items():
                counted[name] = counted.get(name, 0) + parse(amount)
    return used
