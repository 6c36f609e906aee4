"""The cluster as the extender's informers show it: each gpushared node's ledger, CPU and pods, and the mix
of what pods ask for.

Aliyun's cache is where its users' pain comes from (reference §5, §8): it frees memory when deletion starts,
never notices a node's GPU count changing, and keeps a failed bind's reservation. Here each node's ledger is
derived from the node's inventory and the pods bound to it, through the core's single definition of what a
pod holds (``holding_from_pod``): a terminating pod holds until its containers have stopped, and a new GPU
count or size rebuilds the node's ledger. A bind counts its pod here before the watch shows it
(``cache.ClusterCache.assume``, with ``reserving.Reservations`` its book); the filter index
(``index.FilterIndex``) is told of every node whose ledger changed, so its answers are never older than
the ledger.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Protocol

from gpushared import contract
from gpushared.contract import ContractError, GpuInventory, ResourceNames
from gpushared.core.placement.cpu import allocatable_cpu, allocatable_memory, cpu_of, holds_cpu, memory_request
from gpushared.core.placement.fragmentation import NodeClass, NodeRoom, RequestMix, node_class, node_room
from gpushared.core.placement.mixbook import ExpectedMix, MixBook, built_mix, kind_of
from gpushared.core.placement.nodefit import facts_of
from gpushared.core.placement.nodes import NodeState, Rejected, usable
from gpushared.core.shared.bodies import NodeBody, PodBody, annotations_of, gpu_models, meta_of, node_of, uid_of
from gpushared.core.shared.ledger import Holding, Ledger, holding_from_pod, inventory_from_node

log = logging.getLogger(__name__)

#: How often the mix of request sizes (the fgd policy's view of what pods ask for) is counted again.
MIX_SECONDS = 10.0


class MixBuilder(Protocol):
    """Builds a mix of the book's counts elsewhere (``extender.mixing.MixTaker``) and installs it later."""

    def start(self, *, nodes: Mapping[NodeClass, int], rooms: Mapping[NodeRoom, int] | None) -> None: ...

    def collect(self) -> None: ...


class ClusterState:
    """Fed by the node and pod informers' events (``on_node``, ``on_pod``) and by binds (``place``,
    ``remove``), all applied by its owner (``cache.ClusterCache``) on one thread: no lock."""

    def __init__(
        self,
        *,
        resources: ResourceNames,
        clock: Callable[[], float] = time.monotonic,
        changed: Callable[[str], None] = lambda name: None,
        model_label: str = "",
        rooms: bool = True,
        expected: ExpectedMix | None = None,
    ) -> None:
        """``expected``: the operator's expected mix (``--expected-mix``), counted in every mix beside the
        pods seen."""
        self.resources = resources
        #: whether each mix is told what every node has left now (fgd's scarcity: core.placement.fragmentation)
        self.count_rooms = rooms
        #: the node label naming each node's GPU model; pods' node affinity on it says which models a kind of
        #: pod may use (fgd's request mix). Empty: models are not weighed.
        self.model_label = model_label
        self.clock = clock
        #: told the name of every node whose ledger changed
        self.changed = changed
        self.nodes: dict[str, NodeState] = {}
        #: pod uid -> the node it is counted on: a pod's update touches its node, not every node's pods
        self.node_of: dict[str, str] = {}
        #: bound pods whose annotations were edited to name other GPUs, kept on theirs (``_choice_kept``)
        self.allocation_edits = 0
        #: UIDs of bound pods whose GPU annotations or request cannot be read: counted at their spec amounts
        #: as pending on their node (``Holding.problem``), never dropped
        self.unreadable: set[str] = set()
        #: the kinds of the pods counted here and the mixes taken from them (``core.placement.mixbook``: the
        #: trace replay counts its placed tasks with the same book)
        self.book = MixBook(expected)
        #: builds each mix after the first off the owner's thread (``extender.mixing``); None: here, at once
        self.taker: MixBuilder | None = None
        self._mix_counted = -MIX_SECONDS
        #: counts changes of what a node offers any pod (its GPUs, model, allocatable CPU), and the nodes by
        #: class as of that count: counted again only when one changed, not with every mix
        self._shapes = 0
        self._classes: tuple[int, Counter[NodeClass]] = (-1, Counter())
        #: node -> (its ledger, (ledger version, CPU version), what it had left then)
        self._rooms: dict[str, tuple[Ledger, tuple[int, int], NodeRoom]] = {}

    # --- reads -----------------------------------------------------------------------------------------------

    def usable(self, name: str, *, gpus: int = 1) -> tuple[NodeState, Ledger] | Rejected:
        """The node and its ledger, or why it is no candidate at all for a pod on ``gpus`` GPUs."""
        return usable(self.nodes.get(name), name, gpus=gpus, resources=self.resources)

    def request_mix(self) -> RequestMix:
        """What the pods on gpushared nodes ask for, as of at most MIX_SECONDS ago: the mix moves slowly, and
        a new one invalidates every node's ranks. The kinds are counted as pods come and go, so taking a
        new mix costs the number of distinct kinds, not of pods."""
        taker = self.taker
        if taker is not None:
            taker.collect()
        if self.clock() - self._mix_counted >= MIX_SECONDS:
            self._mix_counted = self.clock()
            rooms = self._node_rooms() if self.count_rooms else None
            if taker is None:
                self.book.take(nodes=self._node_classes(), rooms=rooms)
            elif not self.book.mix_generation:  # the first, here and now: the cache takes it before it is ready
                counts, unseen = self.book.counts(), self.book.unseen
                self.book.install(built_mix(counts, nodes=self._node_classes(), rooms=rooms, unseen=unseen))
            else:
                taker.start(nodes=self._node_classes(), rooms=rooms)
        return self.book.mix

    @property
    def mix_generation(self) -> int:
        return self.book.mix_generation

    @property
    def pressure_generation(self) -> int:
        return self.book.pressure_generation

    def _node_rooms(self) -> Counter[NodeRoom]:
        """The gpushared nodes by what they have left now; a node's room is worked out again only when its
        ledger or CPU changed since the last mix (5,000 nodes' ledgers each time cost more than the mix)."""
        rooms: Counter[NodeRoom] = Counter()
        for name, state in self.nodes.items():
            ledger, inventory = state.ledger, state.inventory
            if inventory is None or ledger is None or state.problem:
                continue
            version = (ledger.version, state.cpu_version)
            known = self._rooms.get(name)
            if known is None or known[0] is not ledger or known[1] != version:
                cpu = state.cpu
                room = node_room(
                    (ledger.free(gpu) for gpu in inventory.gpus if gpu.healthy),
                    model=state.model,
                    cpu_free=None if cpu is None else cpu.allocatable - cpu.requested,
                )
                known = self._rooms[name] = (ledger, version, room)
            rooms[known[2]] += 1
        if len(self._rooms) > 2 * len(self.nodes):
            self._rooms = {name: kept for name, kept in self._rooms.items() if name in self.nodes}
        return rooms

    def _node_classes(self) -> Counter[NodeClass]:
        """The gpushared nodes by class: which kinds of pod how many of them could ever host."""
        if self._classes[0] != self._shapes:
            classes = Counter(
                node_class(state.inventory, model=state.model, cpu_allocatable=state.cpu_allocatable)
                for state in self.nodes.values()
                if state.inventory is not None and state.ledger is not None and not state.problem
            )
            self._classes = (self._shapes, classes)
        return self._classes[1]

    def snapshot(self, name: str) -> tuple[GpuInventory, list[Holding], str] | None:
        """The node's inventory, holdings and address, for inspect."""
        state = self.nodes.get(name)
        if state is None or state.ledger is None or state.inventory is None:
            return None
        return state.inventory, list(state.ledger.holdings()), state.address

    def node_names(self) -> list[str]:
        return sorted(n for n, s in self.nodes.items() if s.inventory is not None or s.problem)

    # --- informer handlers ---------------------------------------------------------------------------------

    def on_node(self, old: NodeBody | None, new: NodeBody | None) -> None:
        if new is None:
            if old is not None:
                state = self.nodes.get(meta_of(old).get("name", ""))
                if state is not None:
                    state.inventory, state.problem, state.cpu_allocatable = None, None, None
                    state.facts = None
                    self._shapes += 1
                    self._rebuild(state)
            return
        name = meta_of(new).get("name", "")
        state = self.nodes.setdefault(name, NodeState(name=name))
        addresses = (new.get("status") or {}).get("addresses") or []
        state.address = next((a.get("address", "") for a in addresses if a.get("type") == "InternalIP"), "")
        model = (meta_of(new).get("labels") or {}).get(self.model_label) if self.model_label else None
        if model != state.model:
            state.model = model  # fgd's ranks read the mix as this model sees it: the index keeps them per model
            self._shapes += 1
        state.memory_allocatable = allocatable_memory(new)
        state.facts = facts_of(new)
        cpu = allocatable_cpu(new)
        if cpu != state.cpu_allocatable:
            state.cpu_allocatable = cpu
            state.cpu_version += 1
            self._shapes += 1
        try:
            inventory = inventory_from_node(new, resources=self.resources)
            problem = None
        except ContractError as exc:
            inventory, problem = None, f"its GPU inventory cannot be read: {exc}"
        state.several_gpus = contract.NODE_INVENTORY in annotations_of(new)
        if inventory == state.inventory and problem == state.problem:
            state.inventory = inventory  # the same GPUs; what they use (inspect) may be newer
            return
        state.inventory, state.problem = inventory, problem
        self._shapes += 1
        self._rebuild(state)

    def on_pod(self, old: PodBody | None, new: PodBody | None, *, assumed: Callable[[str], bool]) -> None:
        """A pod event; ``assumed(uid)`` says whether a bind counts the pod that the watch has not shown yet
        (such a pod is not taken out for the watch showing it unbound)."""
        if new is None:
            if old is not None:
                self.remove(uid_of(old))
            return
        if old is not None and uid_of(old) != uid_of(new):
            self.remove(uid_of(old))  # re-created under the same name while the watch was down
        if node_of(new):
            self.place(new)
        elif not assumed(uid_of(new)):
            self.remove(uid_of(new))

    # --- counting ------------------------------------------------------------------------------------------

    def place(self, pod: PodBody) -> None:
        """Count ``pod`` on the node it is bound to (or a bind puts it on), under its UID."""
        node = node_of(pod)
        uid = uid_of(pod)
        state = self.nodes.setdefault(node, NodeState(name=node))
        counted_on = self.node_of.get(uid)
        if counted_on == node:
            pod = self._choice_kept(state, uid, pod)
        if counted_on == node and self._counts_the_same(state, uid, pod):
            # Most often the watch confirming a bind this extender counted already: the ledger keeps its
            # version, so the node's room, reasons and ranks stay valid.
            state.pods[uid] = pod
            return
        if counted_on is not None and counted_on != node:
            self.remove(uid)  # assumed on another node than the watch shows
        self._uncount(state, uid)
        state.pods[uid] = pod
        self.node_of[uid] = node
        self._count(state, pod)

    def remove(self, uid: str) -> None:
        node = self.node_of.pop(uid, None)
        state = self.nodes.get(node) if node is not None else None
        if state is not None:
            self._uncount(state, uid)
            state.pods.pop(uid, None)

    def _choice_kept(self, state: NodeState, uid: str, pod: PodBody) -> PodBody:
        """The pod as counted, with the GPU choice it was counted with: a bound pod's annotations naming
        other GPUs (or none) are an edit by its owner, not a move. Its containers still run on the GPUs the
        kubelet gave them, so the books keep those (``allocation_edits`` counts such edits)."""
        known = state.pods.get(uid)
        if known is None or state.ledger is None:
            return pod
        annotations = meta_of(known).get("annotations")
        if annotations == meta_of(pod).get("annotations"):
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
        return {**pod, "metadata": {**meta_of(pod), "annotations": annotations or {}}}

    def _counts_the_same(self, state: NodeState, uid: str, pod: PodBody) -> bool:
        """Whether ``pod`` would be counted on its node exactly as the body ``state.pods`` holds for it is."""
        known = state.pods.get(uid)
        if known is None or holds_cpu(known) != holds_cpu(pod) or cpu_of(known) != cpu_of(pod):
            return False
        if memory_request(known) != memory_request(pod):
            return False
        if state.ledger is None or not holds_cpu(pod):
            return True
        return state.ledger.holding(uid) == self._holding(pod, state)

    def _count(self, state: NodeState, pod: PodBody) -> None:
        """Count a pod now in ``state.pods`` against its node: its CPU, its holding, its kind in the mix."""
        if not holds_cpu(pod):
            return
        cpu = cpu_of(pod)
        state.cpu_requested += cpu
        state.memory_requested += memory_request(pod)
        state.cpu_version += 1
        if state.ledger is not None:
            self.changed(state.name)
            holding = self._holding(pod, state)
            if holding is not None:
                state.ledger.add(holding)
                if holding.problem is not None:
                    self._unreadable(holding)
            self.book.count(kind_of(cpu, holding, gpu_models(pod, self.model_label)))

    def _uncount(self, state: NodeState, uid: str) -> None:
        """Take back what ``_count`` counted for the pod ``state.pods`` holds under ``uid``, if any."""
        pod = state.pods.get(uid)
        if pod is None or not holds_cpu(pod):
            return
        cpu = cpu_of(pod)
        state.cpu_requested -= cpu
        state.memory_requested -= memory_request(pod)
        state.cpu_version += 1
        self.unreadable.discard(uid)
        if state.ledger is not None:
            self.changed(state.name)
            self.book.uncount(kind_of(cpu, state.ledger.remove(uid), gpu_models(pod, self.model_label)))

    def _rebuild(self, state: NodeState) -> None:
        """A new ledger from the node's inventory (None: no longer a gpushared node) and its pods."""
        self.changed(state.name)
        for uid in state.pods:
            self._uncount(state, uid)
        state.ledger = None if state.inventory is None else Ledger.build(state.inventory)
        for pod in state.pods.values():
            self._count(state, pod)

    def _unreadable(self, holding: Holding) -> None:
        if holding.uid not in self.unreadable:
            self.unreadable.add(holding.uid)
            log.warning(
                "pod %s/%s: counted at its spec amounts on its node, as its GPU annotations cannot be read: %s",
                holding.namespace,
                holding.name,
                holding.problem,
            )

    def _holding(self, pod: PodBody, state: NodeState) -> Holding | None:
        assert state.inventory is not None
        return holding_from_pod(pod, unit=state.inventory.unit, resources=self.resources)
