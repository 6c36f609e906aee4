"""What filter and prioritize read: each node's room, reasons and ranks, kept until its ledger changes.

A filter is answered from one table entry per node (``rooms.Rooms``: the most memory free on a GPU a plain
and an MPS pod may use, ``most_free``), a prioritize from each node's rank for the request, kept in the
node's memo per request and policy. ``ClusterState`` tells the index of every node whose ledger changed, so
nothing here is older than the ledger it was worked out from. Everything runs under the state's lock.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gpushared.contract import MemoryUnit
from gpushared.core.bodies import PodBody, gpu_models
from gpushared.core.policies import NodeRank, Policy, PricingContext, derive_pricing
from gpushared.core.requests import PodRequest
from gpushared.core.verdicts import GpuVerdict, explain, idle_gpu_mib, judge, most_free, no_room
from gpushared.extender.rooms import STALE, Rooms
from gpushared.extender.state import ClusterState, NodeState, Rejected, Version, cpu_of


class RankSlot(NamedTuple):
    """What a node's rank for a pod was worked out from, beside the node's own ledger and CPU: its key in
    the node's memo (the other entries are ``("room", ...)`` and ``("why", ...)``)."""

    kind: str  # "rank"
    policy: str
    total: int
    gpus: int
    mps: bool
    #: the pod's milli-CPU, for a policy that reads it (else 0)
    pod_cpu: int
    #: the mix generation the rank read (``FilterIndex._mixed``)
    mixed: int
    #: whether the pod's node affinity pins it to GPU models
    pinned: bool


#: Entries a node's memo keeps: one per request size and kind seen since its ledger last changed.
MEMO_LIMIT = 256


class FilterIndex:
    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.rooms = Rooms()

    def changed(self, name: str) -> None:
        """The node's ledger changed: its room is worked out again when next asked for."""
        self.rooms.stale(name)

    def judge(self, name: str, pod: PodBody, request: PodRequest) -> tuple[list[GpuVerdict], PricingContext] | Rejected:
        """The node's verdict per GPU for ``request``, and what a policy weighs there beside the GPU (bind's
        choice), or why the node is not a candidate at all.

        Judged under the cache lock against the live ledger: no copy per node, and the informers cannot
        change a ledger half-way through.
        """
        with self.state.lock:
            usable = self.state.usable(name, gpus=request.gpus)
            if isinstance(usable, Rejected):
                return usable
            node, ledger = usable
            context = PricingContext(
                ledger,
                mix=self.state.request_mix(),
                cpu=node.cpu,
                pod_cpu=cpu_of(pod),
                model=node.model,
                pinned=self._pinned(pod),
            )
            return judge(ledger, request), context

    def filter(self, names: list[str], request: PodRequest) -> tuple[list[str], dict[str, str]]:
        """The nodes with GPUs that fit ``request``, and why each other one does not.

        Answered from each node's most free usable GPU (``most_free``), kept until its ledger changes, under
        one hold of the lock: a thousand candidates cost a thousand dict lookups. A node whose usable GPUs
        are too full gets the one reason they all share (``no_room``); only a node with no usable GPU at all
        is judged GPU by GPU, once per ledger change and request, for what is wrong with each. A pod on
        several GPUs (rare: training jobs) is answered from each node's memo instead.
        """
        passed: list[str] = []
        failed: dict[str, str] = {}
        need, mps, several = request.per_gpu, request.mps, request.gpus > 1
        full: dict[str, str] = {}  # unit -> the reason of every too-full node
        with self.state.lock:
            table, units = self.rooms.of(mps=mps), self.rooms.units
            for name in names:
                if several:
                    room = self._room_for_several(name, request)
                else:
                    room = table.get(name, STALE)
                    if room == STALE:
                        room = self._room_of(name)[mps]
                if 0 < need <= room:
                    passed.append(name)
                elif need > 0 and room >= 0:
                    unit = units[name]  # a node with room has a ledger, so a unit
                    reason = full.get(unit)
                    if reason is None:
                        reason = full[unit] = no_room(request, unit=MemoryUnit(unit))
                    failed[name] = reason
                else:
                    failed[name] = self._why_not(name, request)
        return passed, failed

    def node_ranks(self, names: list[str], pod: PodBody, request: PodRequest, policy: Policy) -> list[NodeRank | None]:
        """How ``policy`` ranks each node for the pod (None: it does not fit), kept per node until its
        ledger, its CPU (for a policy that reads it) or what it reads of the request mix changes."""
        keys: list[NodeRank | None] = []
        with self.state.lock:
            mix = self.state.request_mix()
            slot = self._slot(pod, request, policy)
            pod_cpu, pinned = slot.pod_cpu, slot.pinned
            usable, gpus, reads_cpu = self.state.usable, request.gpus, policy.reads_cpu
            for name in names:
                found = usable(name, gpus=gpus)
                if isinstance(found, Rejected):
                    keys.append(None)
                    continue
                node, ledger = found
                version = (ledger.version, node.cpu_version if reads_cpu else 0)
                known = node.memo.get(slot)
                if known is None or known[0] != version:
                    context = PricingContext(
                        ledger, mix=mix, cpu=node.cpu, pod_cpu=pod_cpu, model=node.model, pinned=pinned
                    )
                    appraised = policy.appraise(ledger, request, context)
                    known = _remember(node, slot, version, None if appraised is None else appraised[0])
                keys.append(known[1])
        return keys

    def slot(self, pod: PodBody, request: PodRequest, policy: Policy) -> RankSlot:
        """The key ``policy``'s rank for the pod is kept under in each node's memo: two pods with one slot
        are ranked alike on every node, so the primer prices a slot once (``priming.Primer``)."""
        with self.state.lock:
            self.state.request_mix()  # a mix that is due is taken first, as node_ranks takes it
            return self._slot(pod, request, policy)

    def _slot(self, pod: PodBody, request: PodRequest, policy: Policy) -> RankSlot:
        pod_cpu = cpu_of(pod) if policy.reads_cpu else 0
        # a pod its node affinity pins to GPU models is priced without their pressure (PricingContext.pressure)
        pinned = (policy.reads_mix or policy.reads_pressure) and self._pinned(pod)
        mixed = self._mixed(policy)
        return RankSlot("rank", policy.name, request.total, request.gpus, request.mps, pod_cpu, mixed, pinned)

    def _mixed(self, policy: Policy) -> int:
        """Which mix the policy's ranks were worked out under, as far as they read it: a new mix (every
        MIX_SECONDS) drops a rank that reads the mix, and one that reads only the pressures when those moved;
        otherwise every node would be priced again for every request size after each count, for nothing."""
        if policy.reads_mix:
            return self.state.mix_generation
        if policy.reads_pressure:
            return self.state.pressure_generation
        return 0

    def _pinned(self, pod: PodBody) -> bool:
        """Whether the pod's node affinity pins it to GPU models (the cluster's label): it is then priced
        without the pressure pinned pods put on them (``PricingContext.pressure``)."""
        return gpu_models(pod, self.state.model_label) is not None

    def idle_prices(self, names: list[str]) -> list[float]:
        """The GPU memory a pod that asks for none would leave stranded on each node (``idle_gpu_mib``)."""
        with self.state.lock:
            costs: list[float] = []
            for name in names:
                node = self.state.nodes.get(name)
                costs.append(float(idle_gpu_mib(node.ledger if node is not None else None)))
        return costs

    def warm(self) -> None:
        """Work out every node's room, and what pricing derives from its ledger, now. Right after a start each
        filter would otherwise judge hundreds of nodes GPU by GPU for the first time (docs/benchmarks.md,
        "Figures behind the code"), and the first prioritize derive for a thousand nodes what any size reads."""
        with self.state.lock:
            for name, node in self.state.nodes.items():
                if self.rooms.of(mps=False).get(name, STALE) == STALE:
                    self._room_of(name)
                if node.ledger is not None:
                    derive_pricing(node.ledger)
            self.rooms.compact()

    def _room_of(self, name: str) -> tuple[int, int]:
        usable = self.state.usable(name)
        if isinstance(usable, Rejected):
            known, unit = (-1, -1), ""
        else:
            ledger = usable[1]
            known, unit = (most_free(ledger, mps=False), most_free(ledger, mps=True)), ledger.inventory.unit.value
        if name in self.state.nodes:  # unknown names are not remembered: anyone may send any name
            self.rooms.put(name, plain=known[0], mps=known[1], unit=unit)
        return known

    def _room_for_several(self, name: str, request: PodRequest) -> int:
        """The most units free on each of ``request.gpus`` GPUs the pod may use (-1: too few, or no node)."""
        usable = self.state.usable(name, gpus=request.gpus)
        if isinstance(usable, Rejected):
            return -1
        node, ledger = usable
        key = ("room", request.gpus, request.mps)
        known = node.memo.get(key)
        if known is None or known[0][0] != ledger.version:
            room = most_free(ledger, mps=request.mps, gpus=request.gpus)
            known = _remember(node, key, (ledger.version, 0), room)
        return int(known[1])

    def _why_not(self, name: str, request: PodRequest) -> str:
        """Why no GPU of the node fits: what kube-scheduler shows in the pod's events."""
        usable = self.state.usable(name, gpus=request.gpus)
        if isinstance(usable, Rejected):
            return usable.reason
        node, ledger = usable
        key = ("why", request.total, request.gpus, request.mps)
        why = node.memo.get(key)
        if why is None or why[0][0] != ledger.version:
            why = _remember(node, key, (ledger.version, 0), explain(judge(ledger, request), gpus=request.gpus))
        return str(why[1])


def _remember(node: NodeState, key: tuple[Any, ...], version: Version, value: Any) -> tuple[Version, Any]:
    if len(node.memo) >= MEMO_LIMIT:
        node.memo.clear()  # old sizes and mixes: cheaper to forget all than to track which
    entry = node.memo[key] = (version, value)
    return entry
