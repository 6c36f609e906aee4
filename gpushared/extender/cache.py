"""The extender's view of the cluster: every gpushared node's ledger, fed by informers, never by requests.

Aliyun's cache is where its users' pain comes from (reference §5, §8): it frees memory when deletion starts,
never notices a node's GPU count changing, and keeps a failed bind's reservation. Here each node's ledger is
derived from the node's inventory and the pods bound to it, through the core's single definition of what a
pod holds (``holding_from_pod``): a terminating pod holds until its containers have stopped, a new GPU
count or size rebuilds the node's ledger, and a pod counts only once it is bound — a bind the API server
refused is taken back out at once, and one it may have applied stays counted until the API server says
where the pod is (``reservations``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpushared import contract
from gpushared.contract import ContractError, GpuInfo, GpuInventory, MemoryUnit, ResourceNames
from gpushared.core.bodies import PodBody, key_of, slim_pod, uid_of
from gpushared.core.cpu import allocatable_cpu, cpu_request, holds_cpu
from gpushared.core.fragmentation import Kind, RequestMix
from gpushared.core.ledger import Holding, Ledger, holding_from_pod, inventory_from_node
from gpushared.core.placement import (
    GpuVerdict,
    NodeCpu,
    NodeKey,
    Policy,
    Setting,
    bind_annotations,
    explain,
    fitting,
    idle_gpu_mib,
    judge,
    most_free,
    no_room,
)
from gpushared.core.requests import PodRequest
from gpushared.extender.reservations import (
    CHECK_SECONDS,
    CONFIRM_SECONDS,
    LANDING_SECONDS,
    Action,
    Assumed,
    Settlement,
    settle,
)
from gpushared.extender.rooms import STALE, Rooms
from gpushared.kube.informer import Informer

log = logging.getLogger(__name__)

#: How often the mix of request sizes (the fgd policy's view of what pods ask for) is counted again.
MIX_SECONDS = 10.0


class Reservation(NamedTuple):
    """A bind's choice, counted in the cache: the GPUs, the annotations that record them, their unit."""

    gpus: list[GpuInfo]
    annotations: dict[str, str]
    unit: MemoryUnit


#: What a memo entry was worked out against: (ledger version, CPU version).
Version = tuple[int, int]


@dataclass
class NodeState:
    name: str
    inventory: GpuInventory | None = None
    problem: str | None = None  # why the node's GPUs cannot be read
    #: whether the node's device plugin puts a container on several GPUs: ours does (it writes the inventory
    #: annotation); Aliyun's, whose nodes only advertise capacity, gives a container one GPU
    several_gpus: bool = False
    address: str = ""
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> pod bound here
    ledger: Ledger | None = None
    #: milli-CPU pods may request here (None: the node does not say) and that the pods bound here request
    cpu_allocatable: int | None = None
    cpu_requested: int = 0
    #: counts changes of the two: prices that read CPU are kept per (ledger version, CPU version)
    cpu_version: int = 0
    #: filter's reasons and prioritize's prices for this ledger: key -> ((ledger version, CPU version), value);
    #: emptied when the ledger is rebuilt
    memo: dict[tuple[Any, ...], tuple[Version, Any]] = field(default_factory=dict)

    @property
    def cpu(self) -> NodeCpu | None:
        if self.cpu_allocatable is None:
            return None
        return NodeCpu(allocatable=self.cpu_allocatable, requested=self.cpu_requested)


class ClusterCache:
    def __init__(
        self,
        *,
        list_nodes: Callable[..., Any],
        list_pods: Callable[..., Any],
        resources: ResourceNames,
        clock: Callable[[], float] = time.monotonic,
        watch_seconds: int = 60,
        landing_seconds: float = LANDING_SECONDS,
    ) -> None:
        self.resources = resources
        self.clock = clock
        #: how long after it was sent a Binding whose answer was lost may still land
        self.landing_seconds = landing_seconds
        self._lock = threading.RLock()
        self._nodes: dict[str, NodeState] = {}
        #: binds the watch has not shown yet, by the key they are counted under (``Assumed.key``)
        self._assumed: dict[str, Assumed] = {}
        #: pod uid -> the keys of its unanswered Bindings (rare: only after an API server fault)
        self._unanswered: dict[str, set[str]] = {}
        #: bound pods whose annotations were edited to name other GPUs, kept on theirs (``_choice_kept``)
        self.allocation_edits = 0
        #: when the pod watch was last caught lagging behind a read-back (None: never)
        self._lag_seen: float | None = None
        #: pod uid -> the node it is counted on: a pod's update touches its node, not every node's pods
        self._node_of: dict[str, str] = {}
        #: node -> the most units free on one GPU a plain and an MPS pod may take (``most_free``; -1: none, or
        #: not a usable node); stale whenever the node's ledger changes, so a filter answers most nodes with
        #: one dict lookup and one comparison
        self._rooms = Rooms()
        self._mix = RequestMix()
        #: (milli-CPU, GPU memory units) -> running pods of that kind on gpushared nodes
        self._kinds: Counter[Kind] = Counter()
        self._mix_generation = 0
        self._mix_counted = -MIX_SECONDS
        # Short watches: a watch that neither delivers nor ends within watch_seconds + its grace is dead,
        # and is replaced by a relist (Informer.stale).
        self.nodes = Informer(list_nodes, name="nodes", handler=self._on_node, watch_seconds=watch_seconds)
        self.pods = Informer(
            list_pods, name="pods", handler=self._on_pod, transform=slim_pod, watch_seconds=watch_seconds
        )

    def start(self) -> None:
        self.nodes.start()
        self.pods.start()

    def stop(self) -> None:
        self.nodes.stop()
        self.pods.stop()

    # --- reads -----------------------------------------------------------------------------------------------

    def judge(self, name: str, pod: PodBody, request: PodRequest) -> tuple[list[GpuVerdict], Setting] | str:
        """The node's verdict per GPU for ``request``, and what a policy weighs there beside the GPU (bind's
        choice), or why the node is not a candidate at all.

        Judged under the cache lock against the live ledger: no copy per node, and the informers cannot
        change a ledger half-way through.
        """
        with self._lock:
            usable = self._usable(name, gpus=request.gpus)
            if isinstance(usable, str):
                return usable
            state, ledger = usable
            setting = Setting(ledger, mix=self.request_mix(), cpu=state.cpu, pod_cpu=_cpu_of(pod))
            return judge(ledger, request), setting

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
        with self._lock:
            table, units = self._rooms.of(mps=mps), self._rooms.units
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

    def _room_for_several(self, name: str, request: PodRequest) -> int:
        """The most units free on each of ``request.gpus`` GPUs the pod may use (-1: too few, or no node)."""
        usable = self._usable(name, gpus=request.gpus)
        if isinstance(usable, str):
            return -1
        state, ledger = usable
        key = ("room", request.gpus, request.mps)
        known = state.memo.get(key)
        if known is None or known[0][0] != ledger.version:
            room = most_free(ledger, mps=request.mps, gpus=request.gpus)
            known = _remember(state, key, (ledger.version, 0), room)
        return int(known[1])

    def warm(self) -> None:
        """Work out every node's room now. Right after a start each filter would otherwise judge hundreds of
        nodes GPU by GPU for the first time: 8 ms at p99 with 5,000 nodes, until the table filled."""
        with self._lock:
            for name in self._nodes:
                if self._rooms.of(mps=False).get(name, STALE) == STALE:
                    self._room_of(name)
            self._rooms.compact()

    def _room_of(self, name: str) -> tuple[int, int]:
        usable = self._usable(name)
        if isinstance(usable, str):
            known, unit = (-1, -1), ""
        else:
            ledger = usable[1]
            known, unit = (most_free(ledger, mps=False), most_free(ledger, mps=True)), ledger.inventory.unit.value
        if name in self._nodes:  # unknown names are not remembered: anyone may send any name
            self._rooms.put(name, plain=known[0], mps=known[1], unit=unit)
        return known

    def _why_not(self, name: str, request: PodRequest) -> str:
        """Why no GPU of the node fits: what kube-scheduler shows in the pod's events."""
        usable = self._usable(name, gpus=request.gpus)
        if isinstance(usable, str):
            return usable
        state, ledger = usable
        key = ("why", request.total, request.gpus, request.mps)
        why = state.memo.get(key)
        if why is None or why[0][0] != ledger.version:
            why = _remember(state, key, (ledger.version, 0), explain(judge(ledger, request), gpus=request.gpus))
        return str(why[1])

    def node_keys(self, names: list[str], pod: PodBody, request: PodRequest, policy: Policy) -> list[NodeKey | None]:
        """How ``policy`` ranks each node for the pod (None: it does not fit), kept per node until its
        ledger, its CPU (for a policy that reads it) or the request mix changes."""
        keys: list[NodeKey | None] = []
        with self._lock:
            mix = self.request_mix()
            pod_cpu = _cpu_of(pod) if policy.reads_cpu else 0
            mixed = self._mix_generation if policy.reads_mix else 0
            slot = ("rank", policy.name, request.total, request.gpus, request.mps, pod_cpu, mixed)
            for name in names:
                usable = self._usable(name, gpus=request.gpus)
                if isinstance(usable, str):
                    keys.append(None)
                    continue
                state, ledger = usable
                version = (ledger.version, state.cpu_version if policy.reads_cpu else 0)
                known = state.memo.get(slot)
                if known is None or known[0] != version:
                    setting = Setting(ledger, mix=mix, cpu=state.cpu, pod_cpu=pod_cpu)
                    appraised = policy.appraise(fitting(ledger, request), request, setting)
                    known = _remember(state, slot, version, None if appraised is None else appraised[0])
                keys.append(known[1])
        return keys

    def idle_costs(self, names: list[str]) -> list[float]:
        """The GPU memory a pod that asks for none would leave stranded on each node (``idle_gpu_mib``)."""
        with self._lock:
            costs: list[float] = []
            for name in names:
                state = self._nodes.get(name)
                costs.append(float(idle_gpu_mib(state.ledger if state is not None else None)))
        return costs

    def _usable(self, name: str, *, gpus: int = 1) -> tuple[NodeState, Ledger] | str:
        """The node and its ledger, or why it is no candidate at all for a pod on ``gpus`` GPUs."""
        state = self._nodes.get(name)
        if state is None:
            return f"node {name} is not in the extender's cache (unknown node)"
        if state.problem:
            return f"node {name} is not usable: {state.problem}"
        if state.ledger is None:
            return f"node {name} is not a gpushared node (no GPU inventory and no {self.resources.gpu_mem} capacity)"
        if gpus > 1 and not state.several_gpus:
            return f"node {name} runs Aliyun's device plugin, which gives a container one GPU, not {gpus}"
        return state, state.ledger

    def request_mix(self) -> RequestMix:
        """What the pods on gpushared nodes ask for, as of at most MIX_SECONDS ago: the mix moves slowly, and
        a new one invalidates every node's prices. The kinds are counted as pods come and go, so taking a
        new mix costs the number of distinct kinds, not of pods."""
        with self._lock:
            if self.clock() - self._mix_counted >= MIX_SECONDS:
                self._mix_counted = self.clock()
                self._mix_generation += 1
                self._mix = RequestMix.of_counts(self._kinds)
            return self._mix

    def snapshot(self, name: str) -> tuple[GpuInventory, list[Holding], str] | None:
        """The node's inventory, holdings and address, for inspect."""
        with self._lock:
            state = self._nodes.get(name)
            if state is None or state.ledger is None or state.inventory is None:
                return None
            return state.inventory, list(state.ledger.holdings()), state.address

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(n for n, s in self._nodes.items() if s.inventory is not None or s.problem)

    # --- what a bind changes before the watch shows it -------------------------------------------------

    def reserve(
        self, name: str, pod: PodBody, request: PodRequest, *, policy: Policy, now_ns: int
    ) -> Reservation | str:
        """Choose the pod's GPUs on node ``name`` with ``policy`` and count the pod there at once, with the
        annotations that record the choice; or say why it cannot go there. One hold of the lock from the
        judgement to the count: two binds to one node never both take the same memory."""
        with self._lock:
            known = self._assumed.get(uid_of(pod))  # type: ignore[arg-type]
            if known is not None:
                # Its Binding was created and the watch has not shown it yet: a second one would fail, and
                # counting the pod on another node meanwhile would free the memory it holds on the first.
                return f"it is already bound to node {known.node} (the watch has not shown it yet)"
            judged = self.judge(name, pod, request)
            if isinstance(judged, str):
                return judged
            verdicts, setting = judged
            choice = policy.choose(verdicts, request, setting)
            if choice is None:
                return f"it does not fit node {name}: {explain(verdicts, gpus=request.gpus)}"
            inventory = self._nodes[name].inventory
            assert inventory is not None  # judged usable above
            gpus = [verdict.gpu for verdict in choice]
            meta = pod.get("metadata") or {}
            carried = (meta.get("annotations") or {}).keys()
            annotations = bind_annotations(request, gpus, unit=inventory.unit, now_ns=now_ns, carried=carried)
            annotated = {**pod, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), **annotations}}}
            self.assume(annotated, name)
            return Reservation(gpus=gpus, annotations=annotations, unit=inventory.unit)

    def assume(self, pod: dict[str, Any], node: str) -> None:
        """Count a pod this extender is binding, until the watch or a read-back shows where it is."""
        slim = slim_pod(pod)  # kept as the watch would keep it; its parts may be shared, so copied, not changed
        bound = {**slim, "spec": {**slim["spec"], "nodeName": node}}
        namespace, name = key_of(bound)
        with self._lock:
            now = self.clock()
            uid = uid_of(bound)
            self._assumed[uid] = Assumed(uid, namespace, name, node, since=now, check_at=now + CONFIRM_SECONDS)
            self._place(bound)

    def forget(self, pod: dict[str, Any], node: str) -> None:
        """A Binding the API server refused: it never lands, so its reservation goes at once."""
        uid = uid_of(pod)
        with self._lock:
            known = self._assumed.get(uid)
            if known is not None and known.node == node:
                del self._assumed[uid]
                if self._node_of.get(uid) == node:
                    self._remove(uid)

    def unanswered(self, pod: dict[str, Any], node: str) -> None:
        """A Binding whose answer was lost (timeout, cut connection, 5xx): it may land yet. Its memory stays
        counted on ``node`` under a key of its own until the pod is read back or seen (``reservations``);
        the pod itself is free to be tried elsewhere meanwhile."""
        uid = uid_of(pod)
        with self._lock:
            known = self._assumed.get(uid)
            if known is None or known.node != node or self._node_of.get(uid) != node:
                return  # the watch showed the pod already: it is counted where it is
            body = self._nodes[node].pods[uid]
            del self._assumed[uid]
            self._remove(uid)
            known.unanswered, known.check_at = True, self.clock()
            self._assumed[known.key] = known
            self._unanswered.setdefault(uid, set()).add(known.key)
            self._place({**body, "metadata": {**body["metadata"], "uid": known.key}})
            log.warning("%s: no answer; its memory stays reserved until the pod is read back", known.describe())

    def due(self, *, limit: int) -> list[Assumed]:
        """Reservations to read back now: binds the watch has not confirmed within CONFIRM_SECONDS, and
        unanswered Bindings; each is handed out again only CHECK_SECONDS later."""
        with self._lock:
            now = self.clock()
            found = [assumed for assumed in self._assumed.values() if assumed.check_at <= now][:limit]
            for assumed in found:
                assumed.check_at = now + CHECK_SECONDS
            return found

    def settle(self, assumed: Assumed, read: dict[str, Any] | None) -> Settlement | None:
        """Apply what a read-back of the pod showed (None: 404); None when the watch settled it meanwhile."""
        with self._lock:
            if self._assumed.get(assumed.key) is not assumed:
                return None
            outcome = settle(assumed, read, now=self.clock(), landing=self.landing_seconds)
            if outcome.action is Action.WAIT:
                return outcome
            log.info("%s", outcome.reason)
            if outcome.action is Action.COUNT:
                assert read is not None
                shown = self.pods.get(assumed.namespace, assumed.name)
                if shown is None or uid_of(shown) != assumed.uid or not (shown.get("spec") or {}).get("nodeName"):
                    self._lagging(f"the pod watch has not shown pod {assumed.namespace}/{assumed.name} bound")
                self._settled(assumed.uid)
                self._place(slim_pod(read))
                return outcome
            del self._assumed[assumed.key]
            if assumed.unanswered:
                keys = self._unanswered.get(assumed.uid, set())
                keys.discard(assumed.key)
                if not keys:
                    self._unanswered.pop(assumed.uid, None)
                self._remove(assumed.key)
            elif self._node_of.get(assumed.uid) == assumed.node:
                self._remove(assumed.uid)
            return outcome

    def _settled(self, uid: str) -> None:
        """The pod is seen bound, deleted or re-created: none of its reservations is needed any more (a bound
        pod refuses every other Binding, and a deleted one every Binding)."""
        self._assumed.pop(uid, None)
        for key in self._unanswered.pop(uid, ()):
            self._assumed.pop(key, None)
            self._remove(key)

    def _lagging(self, why: str) -> None:
        """Evidence that the pod watch is behind the API server: relist, at most once per CHECK_SECONDS."""
        now = self.clock()
        if self._lag_seen is None or now - self._lag_seen >= CHECK_SECONDS:
            self._lag_seen = now
            self.pods.relist(why)

    def unconfirmed(self) -> int:
        """Binds counted that neither the watch nor a read-back has confirmed yet."""
        with self._lock:
            return len(self._assumed)

    def stale(self) -> str | None:
        """Why the cache cannot be trusted right now (a watch silent too long, a relist under way after
        the watch was caught lagging), or None."""
        return self.nodes.stale() or self.pods.stale()

    # --- informer handlers ---------------------------------------------------------------------------------

    def _on_node(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        with self._lock:
            if new is None:
                if old is not None:
                    name = (old.get("metadata") or {}).get("name", "")
                    state = self._nodes.get(name)
                    if state is not None:
                        state.inventory, state.problem, state.cpu_allocatable = None, None, None
                        self._rebuild(state)
                return
            name = (new.get("metadata") or {}).get("name", "")
            state = self._nodes.setdefault(name, NodeState(name=name))
            state.address = next(
                (
                    a.get("address", "")
                    for a in (new.get("status") or {}).get("addresses") or []
                    if a.get("type") == "InternalIP"
                ),
                "",
            )
            cpu = allocatable_cpu(new)  # type: ignore[arg-type]
            if cpu != state.cpu_allocatable:
                state.cpu_allocatable = cpu
                state.cpu_version += 1
            try:
                inventory = inventory_from_node(new, resources=self.resources)  # type: ignore[arg-type]
                problem = None
            except ContractError as exc:
                inventory, problem = None, f"its GPU inventory cannot be read: {exc}"
            state.several_gpus = contract.NODE_INVENTORY in ((new.get("metadata") or {}).get("annotations") or {})
            if inventory == state.inventory and problem == state.problem:
                return
            state.inventory, state.problem = inventory, problem
            self._rebuild(state)

    def _on_pod(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        with self._lock:
            if new is None:
                if old is not None:
                    self._settled(uid_of(old))
                    self._unplace(old)
                return
            if old is not None and uid_of(old) != uid_of(new):
                self._settled(uid_of(old))
                self._unplace(old)  # re-created under the same name while the watch was down
            node = (new.get("spec") or {}).get("nodeName")
            if node:
                self._settled(uid_of(new))
                self._place(new)
            elif uid_of(new) not in self._assumed:
                self._unplace(new)

    def _place(self, pod: dict[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName", "")
        uid = uid_of(pod)
        state = self._nodes.setdefault(node, NodeState(name=node))
        counted_on = self._node_of.get(uid)
        if counted_on == node:
            pod = self._choice_kept(state, uid, pod)
        if counted_on == node and self._counts_the_same(state, uid, pod):
            # Most often the watch confirming a bind this extender counted already: the ledger keeps its
            # version, so the node's room, reasons and prices stay valid.
            state.pods[uid] = pod
            return
        if counted_on is not None and counted_on != node:
            self._remove(uid)  # assumed on another node than the watch shows
        self._uncount(state, uid)
        state.pods[uid] = pod
        self._node_of[uid] = node
        self._count(state, pod)

    def _choice_kept(self, state: NodeState, uid: str, pod: dict[str, Any]) -> dict[str, Any]:
        """The pod as counted, with the GPU choice it was counted with: a bound pod's annotations naming
        other GPUs (or none) are an edit by its owner, not a move. Its containers still run on the GPUs the
        kubelet gave them, so the books keep those (``allocation_edits`` counts such edits)."""
        known = state.pods.get(uid)
        if known is None or state.ledger is None:
            return pod
        annotations = (known.get("metadata") or {}).get("annotations")
        if annotations == (pod.get("metadata") or {}).get("annotations"):
            return pod  # the usual event (a status change, the watch confirming a bind): nothing to judge
        before, after = state.ledger.holding(uid), self._holding(pod, state)
        if before is None or not before.gpus or after is None or set(after.gpus) == set(before.gpus):
            return pod
        self.allocation_edits += 1
        log.warning(
            "pod %s/%s: its annotations were edited after bind to name GPUs %s; it stays counted on GPUs %s",
            before.namespace,
            before.name,
            sorted(after.gpus) or "none",
            sorted(before.gpus),
        )
        meta = pod.get("metadata") or {}
        return {**pod, "metadata": {**meta, "annotations": annotations or {}}}

    def _counts_the_same(self, state: NodeState, uid: str, pod: dict[str, Any]) -> bool:
        """Whether ``pod`` would be counted on its node exactly as the body ``state.pods`` holds for it is."""
        known = state.pods.get(uid)
        if known is None or holds_cpu(known) != holds_cpu(pod) or _cpu_of(known) != _cpu_of(pod):  # type: ignore[arg-type]
            return False
        if state.ledger is None or not holds_cpu(pod):  # type: ignore[arg-type]
            return True
        return state.ledger.holding(uid) == self._holding(pod, state)

    def _unplace(self, pod: dict[str, Any]) -> None:
        self._remove(uid_of(pod))

    def _remove(self, uid: str) -> None:
        node = self._node_of.pop(uid, None)
        state = self._nodes.get(node) if node is not None else None
        if state is not None:
            self._uncount(state, uid)
            state.pods.pop(uid, None)

    def _count(self, state: NodeState, pod: dict[str, Any]) -> None:
        """Count a pod now in ``state.pods`` against its node: its CPU, its holding, its kind in the mix."""
        if not holds_cpu(pod):  # type: ignore[arg-type]
            return
        cpu = _cpu_of(pod)
        state.cpu_requested += cpu
        state.cpu_version += 1
        if state.ledger is not None:
            self._rooms.stale(state.name)
            holding = self._holding(pod, state)
            if holding is not None:
                state.ledger.add(holding)
            self._kinds[_kind(cpu, holding)] += 1

    def _uncount(self, state: NodeState, uid: str) -> None:
        """Take back what ``_count`` counted for the pod ``state.pods`` holds under ``uid``, if any."""
        pod = state.pods.get(uid)
        if pod is None or not holds_cpu(pod):  # type: ignore[arg-type]
            return
        cpu = _cpu_of(pod)
        state.cpu_requested -= cpu
        state.cpu_version += 1
        if state.ledger is not None:
            self._rooms.stale(state.name)
            self._forget_kind(_kind(cpu, state.ledger.remove(uid)))

    def _forget_kind(self, kind: Kind) -> None:
        self._kinds[kind] -= 1
        if not self._kinds[kind]:
            del self._kinds[kind]

    def _rebuild(self, state: NodeState) -> None:
        """A new ledger from the node's inventory (None: no longer a gpushared node) and its pods."""
        state.memo.clear()
        self._rooms.stale(state.name)
        for uid in state.pods:
            self._uncount(state, uid)
        state.ledger = None if state.inventory is None else Ledger.build(state.inventory)
        for pod in state.pods.values():
            self._count(state, pod)

    def _holding(self, pod: dict[str, Any], state: NodeState) -> Holding | None:
        assert state.inventory is not None
        return holding_from_pod(pod, unit=state.inventory.unit, resources=self.resources)  # type: ignore[arg-type]


#: Entries a node's memo keeps: one per request size and kind seen since its ledger last changed.
MEMO_LIMIT = 256


def _remember(state: NodeState, key: tuple[Any, ...], version: Version, value: Any) -> tuple[Version, Any]:
    if len(state.memo) >= MEMO_LIMIT:
        state.memo.clear()  # old sizes and mixes: cheaper to forget all than to track which
    entry = state.memo[key] = (version, value)
    return entry


def _kind(cpu: int, holding: Holding | None) -> Kind:
    """A pod's kind in the request mix: its CPU, what it holds (or waits for) on each GPU, and its GPUs."""
    if holding is None:
        return cpu, 0, 0
    if len(holding.gpus) > 1:
        return cpu, max(holding.gpus.values()), len(holding.gpus)
    size = sum(holding.gpus.values()) + holding.pending
    return cpu, size, 1 if size else 0


def _cpu_of(pod: PodBody | dict[str, Any]) -> int:
    """The pod's milli-CPU request; 0 for one whose quantities cannot be read (the API server refuses
    those, so only a body that skipped validation has one; its GPU memory is what must not be lost)."""
    try:
        return cpu_request(pod)  # type: ignore[arg-type]
    except ContractError:
        return 0
