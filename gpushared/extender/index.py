"""What filter and prioritize read: each node's room, reasons and ranks, kept until its ledger changes.

A filter is answered from one table entry per node (:class:`Rooms`: the most memory free on a GPU a plain
and an MPS pod may use, ``most_free``), a prioritize from each node's rank for the request, kept in the
index's memo of the node (:class:`NodeMemo`) per request and policy. The state tells the index of every
node whose ledger changed, and a memo is read only for the ledger, version and GPU model it was worked out
for, so nothing here is older than what it was worked out from.

The index reads the cluster through ``core.placement.nodes.ClusterView`` and owns only what it works out; both are
touched by the cache's owner alone, on one thread (``cache.ClusterCache``): no lock.

The rooms' table is laid out for a filter's lookups: one dict of ints per kind of pod, each node's memory
unit beside them as a string, keys copied side by side (:meth:`Rooms.compact`), and a stale room marked
in place rather than popped. Why, and what it measured: docs/benchmarks.md, "What changed, second pass".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from gpushared.contract import MemoryUnit
from gpushared.core.placement.cpu import cpu_of
from gpushared.core.placement.nodes import ClusterView, NodeState, Rejected
from gpushared.core.placement.policies import NodeRank, Policy
from gpushared.core.placement.pricing import PricingContext, derive_pricing
from gpushared.core.shared.bodies import PodBody, gpu_models
from gpushared.core.shared.ledger import GpuVerdict, Ledger
from gpushared.core.shared.requests import PodRequest
from gpushared.core.shared.verdicts import explain, idle_gpu_mib, judge, most_free, no_room

#: A node's room that must be worked out again; also what a lookup of a name not in the table gives.
STALE = -2

#: New nodes added since the last compaction, as a fraction of the table, before it is compacted again.
REGROWTH = 8

#: Entries a node's memo keeps: one per request size and kind seen since its ledger last changed.
MEMO_LIMIT = 256

#: Nodes a verb prices in one turn of the event loop, at most (``node_ranks``' ``cold``): 1-25 ms of fgd's
#: pricing under the largest expected mix, less without one. The first call of a pod size, or the first
#: after a new mix, priced a thousand nodes in one turn: 0.2-0.5 s, with every other verb waiting.
PRICES_PER_TURN = 24


class Rooms:
    """The most memory free on one GPU, per node and per kind of pod (plain, MPS): what a filter reads
    first. A room is in units of the node's memory unit, -1 when no GPU of the node is usable by that kind
    of pod, STALE when the node's ledger changed since it was worked out."""

    def __init__(self) -> None:
        self.plain: dict[str, int] = {}
        self.mps: dict[str, int] = {}
        #: name -> the value of the node's MemoryUnit ("" for a node with no ledger)
        self.units: dict[str, str] = {}
        self._added = 0

    def __len__(self) -> int:
        return len(self.plain)

    def __contains__(self, name: str) -> bool:
        return name in self.plain

    def of(self, *, mps: bool) -> dict[str, int]:
        """The table for one kind of pod: name -> room, STALE, or missing."""
        return self.mps if mps else self.plain

    def put(self, name: str, *, plain: int, mps: int, unit: str) -> None:
        """A node's rooms, written in place when the node is in the table already. A filter holds on to the
        dicts it started with: a compaction here leaves them complete, since the node goes in first."""
        if name not in self.plain:
            self._added += 1
        self.plain[name], self.mps[name], self.units[name] = plain, mps, unit
        if self._added * REGROWTH > len(self.plain) + 64:
            self.compact()

    def stale(self, name: str) -> None:
        if name in self.plain:
            self.plain[name] = self.mps[name] = STALE

    def compact(self) -> None:
        """Copy every key, one after another, into new dicts: see the module's docstring."""
        keys = [name.encode().decode() for name in self.plain]
        self.plain = dict(zip(keys, self.plain.values(), strict=True))
        self.mps = dict(zip(keys, self.mps.values(), strict=True))
        self.units = dict(zip(keys, self.units.values(), strict=True))
        self._added = 0


class RankSlot(NamedTuple):
    """What a node's rank for a pod was worked out from, beside the node's own ledger and CPU: its key in
    the node's memo (:attr:`NodeMemo.ranks`)."""

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
    #: its compute request, percent of each GPU (0: none)
    compute: int = 0


class NodeMemo:
    """What the index worked out for one node, valid for exactly one ledger at one version and one GPU
    model (fgd's ranks read the mix as that model sees it): ranks per slot, each with the node's CPU version
    it read (0 for a policy that reads no CPU); rooms for pods on several GPUs per (GPUs, MPS); and why no
    GPU fits, per (units, GPUs, MPS)."""

    __slots__ = ("ledger", "model", "ranks", "reasons", "rooms", "version")

    def __init__(self, ledger: Ledger, model: str | None) -> None:
        self.ledger, self.version, self.model = ledger, ledger.version, model
        self.ranks: dict[RankSlot, tuple[int, NodeRank | None]] = {}
        self.rooms: dict[tuple[int, bool], int] = {}
        self.reasons: dict[tuple[int, int, bool], str] = {}

    def holds_for(self, ledger: Ledger, model: str | None) -> bool:
        return self.ledger is ledger and self.version == ledger.version and self.model == model

    def full(self) -> bool:
        return len(self.ranks) + len(self.rooms) + len(self.reasons) >= MEMO_LIMIT


class FilterIndex:
    def __init__(self, state: ClusterView) -> None:
        self.state = state
        self.rooms = Rooms()
        #: node name -> its memo; one that no longer holds for the node's ledger is made anew when next read
        self._memos: dict[str, NodeMemo] = {}

    def changed(self, name: str) -> None:
        """The node's ledger changed: its room is worked out again when next asked for."""
        self.rooms.stale(name)

    def judge(self, name: str, pod: PodBody, request: PodRequest) -> tuple[list[GpuVerdict], PricingContext] | Rejected:
        """The node's verdict per GPU for ``request``, and what a policy weighs there beside the GPU (bind's
        choice), or why the node is not a candidate at all.

        Judged against the live ledger: no copy per node, and nothing changes it half-way through (its owner
        applies every change on the thread that calls this)."""
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
            pod_compute=request.compute_request,
        )
        return judge(ledger, request), context

    def filter(self, names: list[str], request: PodRequest) -> tuple[list[str], dict[str, str]]:
        """The nodes with GPUs that fit ``request``, and why each other one does not.

        Answered from each node's most free usable GPU (``most_free``), kept until its ledger changes: a
        thousand candidates cost a thousand dict lookups. A node whose usable GPUs are too full gets the
        one reason they all share (``no_room``); only a node with no usable GPU at all is judged GPU by
        GPU, once per ledger change and request, for what is wrong with each. A pod on several GPUs (rare:
        training jobs) is answered from each node's memo instead.
        """
        if request.compute_request:
            return self._filter_by_judging(names, request)
        passed: list[str] = []
        failed: dict[str, str] = {}
        need, mps, several = request.per_gpu, request.mps, request.gpus > 1
        full: dict[str, str] = {}  # unit -> the reason of every too-full node
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
                unit = units.get(name, "")  # a node with room has a ledger, so a unit...
                if not unit:  # ...not read yet where only pods on several GPUs were filtered since it came
                    self._room_of(name)
                    unit = self.rooms.units.get(name, "")
                reason = full.get(unit)
                if reason is None:
                    reason = full[unit] = no_room(request, unit=MemoryUnit(unit))
                failed[name] = reason
            else:
                failed[name] = self._why_not(name, request)
        return passed, failed

    def _filter_by_judging(self, names: list[str], request: PodRequest) -> tuple[list[str], dict[str, str]]:
        """:meth:`filter` for a pod with a compute request: each node's GPUs judged on memory and compute
        together (``judge``). A node's most free memory says nothing of its compute, so the one-number
        answer does not apply; such pods are priced GPU by GPU, as a node with no usable GPU always is."""
        passed: list[str] = []
        failed: dict[str, str] = {}
        for name in names:
            usable = self.state.usable(name, gpus=request.gpus)
            if isinstance(usable, Rejected):
                failed[name] = usable.reason
                continue
            verdicts = judge(usable[1], request)
            if request.per_gpu > 0 and sum(v.fits for v in verdicts) >= request.gpus:
                passed.append(name)
            else:
                failed[name] = explain(verdicts, gpus=request.gpus)
        return passed, failed

    def node_ranks(
        self, names: list[str], pod: PodBody, request: PodRequest, policy: Policy, *, cold: list[str] | None = None
    ) -> list[NodeRank | None]:
        """How ``policy`` ranks each node for the pod (None: it does not fit), kept per node until its
        ledger, its CPU (for a policy that reads it) or what it reads of the request mix changes.

        ``cold``: given, the call prices at most PRICES_PER_TURN nodes; every other node whose rank is not
        in its memo is appended to it (and answered None), for the caller to price over the next turns of
        the event loop before it asks again (``Scheduler.paced``)."""
        keys: list[NodeRank | None] = []
        mix = self.state.request_mix()
        slot = self._slot(pod, request, policy)
        pod_cpu, pinned = slot.pod_cpu, slot.pinned
        nodes, several, reads_cpu, memos = self.state.nodes, request.gpus > 1, policy.reads_cpu, self._memos
        budget = -1 if cold is None else PRICES_PER_TURN  # -1: no limit
        for name in names:
            # ``usable`` and ``NodeMemo.holds_for`` written out: a thousand candidates a call, and the two
            # calls were a quarter of a warm prioritize (docs/benchmarks.md, "One owner of the state")
            node = nodes.get(name)
            if node is None or node.ledger is None or node.problem or (several and not node.several_gpus):
                keys.append(None)
                continue
            ledger = node.ledger
            memo = memos.get(name)
            if memo is None or memo.ledger is not ledger or memo.version != ledger.version or memo.model != node.model:
                memo = self._memo(node, ledger)
            cpu_version = node.cpu_version if reads_cpu else 0
            known = memo.ranks.get(slot)
            if known is None or known[0] != cpu_version:
                if budget == 0 and cold is not None:
                    cold.append(name)
                    keys.append(None)
                    continue
                budget -= 1
                context = PricingContext(
                    ledger,
                    mix=mix,
                    cpu=node.cpu,
                    pod_cpu=pod_cpu,
                    model=node.model,
                    pinned=pinned,
                    pod_compute=request.compute_request,
                )
                appraised = policy.appraise(ledger, request, context)
                if memo.full():
                    memo = self._memo(node, ledger)  # old sizes and mixes: cheaper to forget all than to track
                known = memo.ranks[slot] = (cpu_version, None if appraised is None else appraised[0])
            keys.append(known[1])
        return keys

    def slot(self, pod: PodBody, request: PodRequest, policy: Policy) -> RankSlot:
        """The key ``policy``'s rank for the pod is kept under in each node's memo: two pods with one slot
        are ranked alike on every node, so the primer prices a slot once (``priming.Primer``)."""
        self.state.request_mix()  # a mix that is due is taken first, as node_ranks takes it
        return self._slot(pod, request, policy)

    def _slot(self, pod: PodBody, request: PodRequest, policy: Policy) -> RankSlot:
        pod_cpu = cpu_of(pod) if policy.reads_cpu else 0
        # a pod its node affinity pins to GPU models is priced without their pressure (PricingContext.pressure)
        pinned = (policy.reads_mix or policy.reads_pressure) and self._pinned(pod)
        mixed = self._mixed(policy)
        return RankSlot(
            policy.name, request.total, request.gpus, request.mps, pod_cpu, mixed, pinned, request.compute_request
        )

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

    def idle_prices(self, names: list[str], *, ledger_of: Callable[[str], Ledger | None] | None = None) -> list[float]:
        """The GPU memory a pod that asks for none would leave stranded on each node (``idle_gpu_mib``), over
        the node's ledger or what ``ledger_of`` says holds its GPUs."""
        if ledger_of is not None:
            return [float(idle_gpu_mib(ledger_of(name))) for name in names]
        nodes = self.state.nodes
        costs: list[float] = []
        for name in names:
            node = nodes.get(name)
            costs.append(float(idle_gpu_mib(node.ledger if node is not None else None)))
        return costs

    def warm(self) -> None:
        """Work out every node's room, and what pricing derives from its ledger, now. Right after a start each
        filter would otherwise judge hundreds of nodes GPU by GPU for the first time (docs/benchmarks.md,
        "Figures behind the code"), and the first prioritize derive for a thousand nodes what any size reads."""
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
        memo = self._memo_of(*usable)
        key = (request.gpus, request.mps)
        room = memo.rooms.get(key)
        if room is None:
            room = memo.rooms[key] = most_free(usable[1], mps=request.mps, gpus=request.gpus)
        return room

    def _why_not(self, name: str, request: PodRequest) -> str:
        """Why no GPU of the node fits: what kube-scheduler shows in the pod's events."""
        usable = self.state.usable(name, gpus=request.gpus)
        if isinstance(usable, Rejected):
            return usable.reason
        memo = self._memo_of(*usable)
        key = (request.total, request.gpus, request.mps)
        why = memo.reasons.get(key)
        if why is None:
            why = memo.reasons[key] = explain(judge(usable[1], request), gpus=request.gpus)
        return why

    def _memo_of(self, node: NodeState, ledger: Ledger) -> NodeMemo:
        """The node's memo for its ledger as it is, with room for one more entry."""
        memo = self._memos.get(node.name)
        if memo is None or not memo.holds_for(ledger, node.model) or memo.full():
            memo = self._memo(node, ledger)
        return memo

    def _memo(self, node: NodeState, ledger: Ledger) -> NodeMemo:
        memo = self._memos[node.name] = NodeMemo(ledger, node.model)
        if len(self._memos) > 2 * len(self.state.nodes) + 64:  # nodes gone: their memos go
            self._memos = {name: kept for name, kept in self._memos.items() if name in self.state.nodes}
        return memo
