"""Invariants of the core, checked by hypothesis over many generated nodes, pods and histories.

- No sequence of placements and removals ever puts a GPU over capacity (memory, or compute requests past
  100 %), places on an unhealthy GPU, or mixes MPS and plain pods on one GPU.
- What a placement writes into annotations reads back (through a fresh ledger, as after a restart) as
  exactly the accounting the placement made.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from gpushared import contract
from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.placement.binding import bind_annotations, holding_for
from gpushared.core.placement.cpu import cpu_request, memory_request
from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.policies import POLICIES
from gpushared.core.placement.pricing import NodeCpu, PricingContext
from gpushared.core.shared.bodies import slim_pod
from gpushared.core.shared.ledger import GpuMode, Ledger, holding_from_pod
from gpushared.core.shared.requests import ContainerRequest, PodRequest, peak, pod_request
from gpushared.core.shared.verdicts import fitting, judge, most_free
from tests.builders import GPU_MEM, on_gpus, pod

EXAMPLES = 300


@st.composite
def inventories(draw: st.DrawFn) -> GpuInventory:
    unit = draw(st.sampled_from(MemoryUnit))
    count = draw(st.integers(min_value=1, max_value=8))
    high = 80 if unit is MemoryUnit.GIB else 81920
    gpus = tuple(
        GpuInfo(
            index=i,
            uuid=f"GPU-{i}",
            model="m",
            memory=(memory := draw(st.integers(min_value=1, max_value=high))),
            memory_mib=unit.to_mib(memory),
            healthy=draw(st.booleans() | st.just(True)),
            mps_capable=draw(st.booleans()),
        )
        for i in range(count)
    )
    return GpuInventory(unit=unit, gpus=gpus)


@st.composite
def pod_bodies(draw: st.DrawFn, *, high: int = 40, compute: bool = False) -> dict[str, Any]:
    def containers(prefix: str, *, init: bool) -> list[dict[str, Any]]:
        found = []
        for i in range(draw(st.integers(min_value=0 if init else 1, max_value=3))):
            body: dict[str, Any] = {"name": f"{prefix}{i}"}
            amount = draw(st.integers(min_value=0, max_value=high))
            if amount:
                body["resources"] = {"limits": {GPU_MEM: str(amount)}}
            if init and draw(st.booleans()):
                body["restartPolicy"] = "Always"
            found.append(body)
        return found

    annotations = {contract.POD_MPS: "true"} if draw(st.booleans()) else {}
    spec = {"initContainers": containers("i", init=True), "containers": containers("c", init=False)}
    asks = any("resources" in c for c in spec["initContainers"] + spec["containers"])
    if compute and asks and draw(st.booleans()):  # a compute share: a request, a limit, or both
        request = draw(st.integers(0, 70))
        limit = draw(st.integers(max(request, 1), 100))
        given = draw(st.sampled_from(["request", "limit", "both"]))
        if given != "limit":
            annotations[contract.POD_COMPUTE_REQUEST] = str(request)
        if given != "request":
            annotations[contract.POD_COMPUTE_LIMIT] = str(limit)
    return {
        "metadata": {"name": "p", "namespace": "d", "uid": "x", "annotations": annotations},
        "spec": spec,
        "status": {"phase": "Pending"},
    }


@settings(max_examples=EXAMPLES)
@given(inventory=inventories(), body=pod_bodies(), now=st.integers(min_value=0, max_value=2**63 - 1))
def test_annotations_read_back_as_the_same_accounting(inventory: GpuInventory, body: dict[str, Any], now: int) -> None:
    request = pod_request(body)
    gpu = inventory.gpus[now % len(inventory.gpus)]
    body["metadata"]["annotations"].update(bind_annotations(request, [gpu], unit=inventory.unit, now_ns=now))
    body["spec"]["nodeName"] = "n1"
    holding = holding_from_pod(body, unit=inventory.unit)
    if request.total == 0 and not request.containers:
        return
    assert holding is not None
    assert holding.gpus == {gpu.index: request.total}
    assert holding.mps == request.mps
    assert (holding.pending, holding.problem) == (0, None)
    assert int(body["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_POD]) == request.total


@settings(max_examples=EXAMPLES)
@given(st.lists(st.tuples(st.integers(0, 50), st.sampled_from(["app", "init", "sidecar"])), max_size=8))
def test_peak_is_bounded_by_the_largest_container_and_the_sum(spec: list[tuple[int, str]]) -> None:
    # Kubernetes lists init containers first; keep that order.
    ordered = sorted(spec, key=lambda c: c[1] == "app")
    containers = [
        ContainerRequest(f"c{i}", a, init=k != "app", sidecar=k == "sidecar") for i, (a, k) in enumerate(ordered)
    ]
    total = peak(containers)
    assert total <= sum(c.amount for c in containers)
    assert all(total >= c.amount for c in containers)
    assert total >= sum(c.amount for c in containers if not c.init or c.sidecar)


@settings(max_examples=EXAMPLES)
@given(st.integers(0, 10**6))
def test_unit_conversion_round_trip(amount: int) -> None:
    assert MemoryUnit.MIB.convert(MemoryUnit.GIB.convert(amount, to=MemoryUnit.MIB), to=MemoryUnit.GIB) == amount
    assert MemoryUnit.GIB.to_mib(MemoryUnit.MIB.convert(amount, to=MemoryUnit.GIB)) >= amount


class PlacementHistory(RuleBasedStateMachine):
    """Pods arrive (placed by any policy when some GPU takes them) and leave, in any order."""

    pods = Bundle("pods")

    def __init__(self) -> None:
        super().__init__()
        self.ledger: Ledger | None = None
        self.bodies: dict[str, dict[str, Any]] = {}
        self.serial = 0
        # what fgd expects (pods of one CPU each, some without GPU); the others ignore it
        self.mix = RequestMix(
            [(1000, size, 1 if size else 0) for size in (0, 1, 2, 3, 4, 6, 8, 12, 16)] + [(1000, 8, 2), (2000, 16, 4)]
        )

    @rule(inventory=inventories())
    def start(self, inventory: GpuInventory) -> None:
        if self.ledger is None:
            self.ledger = Ledger.build(inventory)

    @rule(target=pods, body=pod_bodies(high=48, compute=True), policy=st.sampled_from(sorted(POLICIES)))
    def place(self, body: dict[str, Any], policy: str) -> str:
        return self._put(body, policy)

    @rule(
        target=pods,
        share=st.integers(1, 24),
        gpus=st.integers(2, 4),
        policy=st.sampled_from(sorted(POLICIES)),
        compute=st.sampled_from([0, 0, 30, 50, 70]),
    )
    def place_on_several_gpus(self, share: int, gpus: int, policy: str, compute: int) -> str:
        body = on_gpus(pod("several", share * gpus), gpus)
        if compute:
            body["metadata"]["annotations"][contract.POD_COMPUTE_REQUEST] = str(compute)
        return self._put(body, policy)

    def _put(self, body: dict[str, Any], policy: str) -> str:
        if self.ledger is None:
            return ""
        self.serial += 1
        uid = f"pod-{self.serial}"
        body["metadata"].update(uid=uid, name=uid)
        request = pod_request(body)
        setting = PricingContext(self.ledger, mix=self.mix, cpu=NodeCpu(allocatable=8000, requested=1000), pod_cpu=1000)
        choice = POLICIES[policy].choose(judge(self.ledger, request), request, setting)
        if choice is None:
            return ""
        gpus = [verdict.gpu for verdict in choice]
        body["metadata"]["annotations"].update(
            bind_annotations(request, gpus, unit=self.ledger.unit, now_ns=self.serial)
        )
        self.ledger.add(holding_for(request, gpus, uid=uid, namespace="d", name=uid))
        assert len({gpu.index for gpu in gpus}) == request.gpus  # distinct GPUs, as many as asked
        self.bodies[uid] = body
        return uid

    @rule(uid=consumes(pods))
    def leave(self, uid: str) -> None:
        if self.ledger is not None and uid:
            self.ledger.remove(uid)
            del self.bodies[uid]

    @rule(amount=st.integers(0, 64), mps=st.booleans(), gpus=st.integers(1, 4), compute=st.integers(0, 100))
    def the_shortcuts_agree_with_judging_every_gpu(self, amount: int, mps: bool, gpus: int, compute: int) -> None:
        if self.ledger is None:
            return
        containers = (ContainerRequest("c", amount * gpus, gpus=gpus),) if amount else ()
        request = PodRequest(containers=containers, mps=mps)
        verdicts = judge(self.ledger, request)
        fits = sum(v.fits for v in verdicts) >= gpus
        assert fits == (0 < amount <= most_free(self.ledger, mps=mps, gpus=gpus))
        assert fitting(self.ledger, request) == [v for v in verdicts if v.fits]
        # with a compute request: what fits is what fits on memory and has that much compute unrequested
        asking = PodRequest(containers=containers, mps=mps, compute=contract.ComputeShare(request=compute))
        judged = judge(self.ledger, asking)
        assert fitting(self.ledger, asking) == [v for v in judged if v.fits]
        assert [v.gpu for v in judged if v.fits] == [
            v.gpu for v in verdicts if v.fits and self.ledger.compute_free(v.gpu.index) >= compute
        ]
        # What pricing keeps on the ledger (per version) is what the ledger says now, after every add and remove.
        healthy = [gpu for gpu in self.ledger.inventory.gpus if gpu.healthy]
        _, frees, _, free_total = PricingContext(self.ledger)._gpus
        assert frees == [max(self.ledger.free(gpu), 0) for gpu in healthy] and free_total == sum(frees)

    @invariant()
    def no_gpu_over_capacity_or_mixed(self) -> None:
        if self.ledger is None:
            return
        for gpu in self.ledger.inventory.gpus:
            assert self.ledger.used(gpu.index) <= gpu.memory
            assert self.ledger.compute_used(gpu.index) <= 100
            assert self.ledger.compute_used(gpu.index) == sum(
                h.compute for h in self.ledger.holdings() if gpu.index in h.gpus
            )
            if not gpu.healthy:
                assert self.ledger.used(gpu.index) == 0
            if self.ledger.mode(gpu.index) is GpuMode.MPS:
                assert gpu.mps_capable
                assert all(h.mps for h in self.ledger.holdings() if gpu.index in h.gpus)
            if self.ledger.mode(gpu.index) is GpuMode.SHARED:
                assert not any(h.mps for h in self.ledger.holdings() if gpu.index in h.gpus)

    @invariant()
    def ledger_rebuilt_from_annotations_agrees(self) -> None:
        if self.ledger is None:
            return
        holdings = [holding_from_pod(body, unit=self.ledger.unit) for body in self.bodies.values()]
        rebuilt = Ledger.build(self.ledger.inventory, [h for h in holdings if h is not None])
        for gpu in self.ledger.inventory.gpus:
            assert rebuilt.used(gpu.index) == self.ledger.used(gpu.index)
            assert rebuilt.mode(gpu.index) == self.ledger.mode(gpu.index)
            assert rebuilt.compute_used(gpu.index) == self.ledger.compute_used(gpu.index)


PlacementHistory.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None)
TestPlacementHistory = PlacementHistory.TestCase


@settings(max_examples=200)
@given(
    inventory=inventories(),
    body=pod_bodies(),
    now=st.integers(0, 2**62),
    deleting=st.booleans(),
    terminated=st.lists(st.booleans(), max_size=3),
)
def test_a_slim_pod_holds_and_asks_what_the_whole_pod_does(
    inventory: GpuInventory, body: dict[str, Any], now: int, deleting: bool, terminated: list[bool]
) -> None:
    """The extender's cache keeps pods slim: nothing it reads may be lost."""
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-11-22T21:00:00Z"
    body["status"]["containerStatuses"] = [
        {"name": f"c{i}", "ready": False, "state": {"terminated": {"exitCode": 0}} if done else {"running": {}}}
        for i, done in enumerate(terminated)
    ]
    for container in body["spec"]["containers"]:
        container["image"] = "busybox"
        resources = container.setdefault("resources", {})
        resources.setdefault("requests", {}).update({"cpu": "100m", "memory": "1Gi"})
        resources.setdefault("limits", {}).update({"cpu": "2", "memory": "1Gi"})
    request = pod_request(body)
    if inventory.gpus and request.total:
        body["metadata"]["annotations"] = {
            **(body["metadata"].get("annotations") or {}),
            **bind_annotations(request, [inventory.gpus[0]], unit=inventory.unit, now_ns=now),
            "kubectl.kubernetes.io/last-applied-configuration": "{...}",
        }
    body["spec"]["nodeName"] = "n1"
    body["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    body.setdefault("status", {})["phase"] = "Running"
    slim = slim_pod(body)
    assert pod_request(slim) == request
    assert holding_from_pod(slim, unit=inventory.unit) == holding_from_pod(body, unit=inventory.unit)
    assert "volumes" not in slim["spec"]
    assert cpu_request(slim) == cpu_request(body)  # what fgd weighs
    assert memory_request(slim) == memory_request(body)  # what the claim allocator's tie-break weighs
    for container in slim["spec"]["containers"]:  # no limits but GPU ones, no image: nothing it does not read
        assert set(container) <= {"name", "resources", "restartPolicy"}
        requested = set(container.get("resources", {}).get("requests", {}))
        assert requested <= {"cpu", "memory", contract.DEFAULT_RESOURCES.gpu_mem}
        assert set(container.get("resources", {}).get("limits", {})) <= {contract.DEFAULT_RESOURCES.gpu_mem}
    assert slim_pod(copy.deepcopy(body)) == slim  # equal pods share their parts, and still read the same
    assert "kubectl.kubernetes.io/last-applied-configuration" not in slim["metadata"].get("annotations", {})
