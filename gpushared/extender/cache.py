"""The extender's view of the cluster: every gpushared node's ledger, fed by informers, never by requests.

Aliyun's cache is where its users' pain comes from (reference §5, §8): it frees memory when deletion starts,
never notices a node's GPU count changing, and keeps a failed bind's reservation. Here each node's ledger is
derived from the node's inventory and the pods bound to it, through the core's single definition of what a
pod holds (``holding_from_pod``): a terminating pod holds until its containers have stopped, a new GPU
count or size rebuilds the node's ledger, and a pod counts only once it is bound — a bind that fails is
taken back out at once.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpushared.contract import ContractError, GpuInventory, MemoryUnit, ResourceNames
from gpushared.core.fragmentation import RequestMix
from gpushared.core.ledger import Holding, Ledger, holding_from_pod, inventory_from_node
from gpushared.core.placement import GpuVerdict, judge
from gpushared.core.requests import PodRequest
from gpushared.kube.informer import Informer, uid_of

log = logging.getLogger(__name__)

#: How long a bind this extender made counts before the watch shows the bound pod.
ASSUME_SECONDS = 60.0
#: How often the mix of request sizes (the fgd policy's view of what pods ask for) is counted again.
MIX_SECONDS = 10.0


@dataclass
class NodeState:
    name: str
    inventory: GpuInventory | None = None
    problem: str | None = None  # why the node's GPUs cannot be read
    address: str = ""
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> pod bound here
    ledger: Ledger | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # serialises binds to this node


class ClusterCache:
    def __init__(
        self,
        *,
        list_nodes: Callable[..., Any],
        list_pods: Callable[..., Any],
        resources: ResourceNames,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.resources = resources
        self.clock = clock
        self._lock = threading.RLock()
        self._nodes: dict[str, NodeState] = {}
        self._assumed: dict[str, tuple[str, float]] = {}  # pod uid -> (node, deadline)
        self._next_expiry = 0.0
        self._mix = RequestMix()
        self._mix_counted = -MIX_SECONDS
        self.nodes = Informer(list_nodes, name="nodes", handler=self._on_node)
        self.pods = Informer(list_pods, name="pods", handler=self._on_pod)

    def start(self) -> None:
        self.nodes.start()
        self.pods.start()

    def stop(self) -> None:
        self.nodes.stop()
        self.pods.stop()

    @property
    def synced(self) -> bool:
        return self.nodes.synced and self.pods.synced

    # --- reads -----------------------------------------------------------------------------------------------

    def judge(self, name: str, request: PodRequest) -> list[GpuVerdict] | str:
        """The node's verdict per GPU for ``request``, or why the node is not a candidate at all.

        Judged under the cache lock against the live ledger: no copy per node, so filtering a thousand
        nodes stays cheap, and the informers cannot change a ledger half-way through.
        """
        with self._lock:
            self._expire_assumed()
            state = self._nodes.get(name)
            if state is None:
                return f"node {name} is not in the extender's cache (unknown node)"
            if state.problem:
                return f"node {name} is not usable: {state.problem}"
            if state.ledger is None:
                return (
                    f"node {name} is not a gpushared node (no GPU inventory and no {self.resources.gpu_mem} capacity)"
                )
            return judge(state.ledger, request)

    def request_mix(self) -> RequestMix:
        """What the pods on gpushared nodes ask for, counted again at most every MIX_SECONDS: the mix moves
        slowly, and counting 150k pods on every request would cost more than it tells."""
        with self._lock:
            if self.clock() - self._mix_counted >= MIX_SECONDS:
                self._mix_counted = self.clock()
                self._mix = RequestMix(
                    sum(h.gpus.values()) + h.pending
                    for state in self._nodes.values()
                    if state.ledger is not None
                    for h in state.ledger.holdings()
                )
            return self._mix

    def unit_of(self, name: str) -> MemoryUnit:
        with self._lock:
            state = self._nodes.get(name)
            return state.inventory.unit if state is not None and state.inventory is not None else MemoryUnit.GIB

    def snapshot(self, name: str) -> tuple[GpuInventory, list[Holding], str] | None:
        """The node's inventory, holdings and address, for inspect."""
        with self._lock:
            self._expire_assumed()
            state = self._nodes.get(name)
            if state is None or state.ledger is None or state.inventory is None:
                return None
            return state.inventory, list(state.ledger.holdings()), state.address

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(n for n, s in self._nodes.items() if s.inventory is not None or s.problem)

    @contextmanager
    def binding(self, name: str) -> Iterator[NodeState | None]:
        """Hold the node's bind lock (one bind per node at a time in this process)."""
        with self._lock:
            state = self._nodes.get(name)
        if state is None:
            yield None
            return
        with state.lock:
            yield state

    # --- what a bind changes before the watch shows it -------------------------------------------------

    def assume(self, pod: dict[str, Any], node: str) -> None:
        """Count a pod this extender just bound, until the watch delivers it bound (or the time runs out)."""
        bound = copy.deepcopy(pod)
        bound.setdefault("spec", {})["nodeName"] = node
        with self._lock:
            self._assumed[uid_of(bound)] = (node, self.clock() + ASSUME_SECONDS)
            self._place(bound)

    def forget(self, pod: dict[str, Any], node: str) -> None:
        """A bind that failed: its reservation goes at once."""
        uid = uid_of(pod)
        with self._lock:
            self._assumed.pop(uid, None)
            state = self._nodes.get(node)
            if state is not None and uid in state.pods:
                del state.pods[uid]
                if state.ledger is not None:
                    state.ledger.remove(uid)

    def _expire_assumed(self) -> None:
        """Release binds the watch never confirmed. Called on reads, so at most once a second: a filter
        judges every candidate node and must not walk the assumed pods for each."""
        now = self.clock()
        if now < self._next_expiry:
            return
        self._next_expiry = now + 1.0
        for uid, (node, deadline) in list(self._assumed.items()):
            if deadline < now:
                del self._assumed[uid]
                current = self.pods.get(*_pod_key(self._nodes.get(node), uid))
                if current is None or (current.get("spec") or {}).get("nodeName") != node:
                    log.warning("bind of pod %s to %s never showed in the watch; releasing it", uid, node)
                    self.forget({"metadata": {"uid": uid}}, node)

    # --- informer handlers ---------------------------------------------------------------------------------

    def _on_node(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        with self._lock:
            if new is None:
                if old is not None:
                    name = (old.get("metadata") or {}).get("name", "")
                    state = self._nodes.get(name)
                    if state is not None:
                        state.inventory, state.ledger, state.problem = None, None, None
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
            try:
                inventory = inventory_from_node(new, resources=self.resources)  # type: ignore[arg-type]
                problem = None
            except ContractError as exc:
                inventory, problem = None, f"its GPU inventory cannot be read: {exc}"
            if inventory == state.inventory and problem == state.problem:
                return
            state.inventory, state.problem = inventory, problem
            self._rebuild(state)

    def _on_pod(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        with self._lock:
            if new is None:
                if old is not None:
                    self._unplace(old)
                return
            if old is not None and (old.get("spec") or {}).get("nodeName") != (new.get("spec") or {}).get("nodeName"):
                self._unplace(old)
            node = (new.get("spec") or {}).get("nodeName")
            if node:
                self._assumed.pop(uid_of(new), None)
                self._place(new)
            elif uid_of(new) not in self._assumed:
                self._unplace(new)

    def _place(self, pod: dict[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName", "")
        state = self._nodes.setdefault(node, NodeState(name=node))
        uid = uid_of(pod)
        state.pods[uid] = pod
        if state.ledger is not None:
            holding = self._holding(pod, state)
            if holding is None:
                state.ledger.remove(uid)
            else:
                state.ledger.add(holding)

    def _unplace(self, pod: dict[str, Any]) -> None:
        uid = uid_of(pod)
        for state in self._nodes.values():
            if uid in state.pods:
                del state.pods[uid]
                if state.ledger is not None:
                    state.ledger.remove(uid)

    def _rebuild(self, state: NodeState) -> None:
        if state.inventory is None:
            state.ledger = None
            return
        state.ledger = Ledger.build(state.inventory)
        for pod in state.pods.values():
            holding = self._holding(pod, state)
            if holding is not None:
                state.ledger.add(holding)

    def _holding(self, pod: dict[str, Any], state: NodeState) -> Holding | None:
        assert state.inventory is not None
        return holding_from_pod(pod, unit=state.inventory.unit, resources=self.resources)  # type: ignore[arg-type]


def _pod_key(state: NodeState | None, uid: str) -> tuple[str, str]:
    pod = state.pods.get(uid) if state is not None else None
    meta = (pod or {}).get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")
