"""The extender's view of the cluster, and its one owner.

kube-scheduler keeps one cache of the cluster, changed only by its informers' events and by its own
``AssumePod`` / ``ForgetPod``, and read by plugins that never own it. So does the extender:
:class:`ClusterCache` owns

- ``state.ClusterState``: what the informers show — each gpushared node's ledger, CPU and pods, and the
  mix of what pods ask for — through the core's single definition of what a pod holds;
- ``index.FilterIndex``: what filter and prioritize read — rooms, reasons and ranks per node, kept until
  the node's ledger changes;
- ``reserving.Reservations``: binds counted before the watch shows them (assumed), until evidence (the
  watch, a read-back) says where the pod is: the fixes for stalled watches and Bindings that land late;
- the pods waiting for a node, by name: what a bind reads the pod from, and what the fence weighs.

All of it is touched by one thread, the event loop's (``inbox.Owner``); the informers' threads only put
their changes in the inbox, which the loop drains between the verbs. No lock guards any of it: a verb
runs start to finish on the loop, so what it reads cannot change under it, and two binds to one node
see each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from gpushared.contract import ContractError, GpuInfo, MemoryUnit, ResourceNames
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.placement.mixbook import ExpectedMix
from gpushared.core.placement.nodes import Rejected
from gpushared.core.placement.policies import Policy
from gpushared.core.placement.reservations import LANDING_SECONDS, Action, Assumed, Settlement
from gpushared.core.placement.steering import STEER_GATE
from gpushared.core.shared.bodies import (
    Key,
    NodeBody,
    PodBody,
    annotations_of,
    awaits_node,
    has_gate,
    key_of,
    meta_of,
    scheduler_of,
    slim_pod,
    uid_of,
)
from gpushared.core.shared.ledger import GpuVerdict
from gpushared.core.shared.requests import PodRequest, pod_request
from gpushared.core.shared.verdicts import explain
from gpushared.extender.budgets import DisruptionBudgets
from gpushared.extender.inbox import BATCH, Inbox, Owner
from gpushared.extender.index import FilterIndex
from gpushared.extender.reserving import Reservations
from gpushared.extender.state import ClusterState
from gpushared.kube.informer import Informer
from gpushared.kube.rest import Lister

__all__ = ["ClusterCache", "Rejected", "Reservation"]


class Reservation(NamedTuple):
    """A bind's choice, counted in the cache: the GPUs, the annotations that record them, their unit."""

    gpus: list[GpuInfo]
    annotations: dict[str, str]
    unit: MemoryUnit


class ClusterCache:
    def __init__(
        self,
        *,
        list_nodes: Lister,
        list_pods: Lister,
        resources: ResourceNames,
        clock: Callable[[], float] = time.monotonic,
        watch_seconds: int = 60,
        landing_seconds: float = LANDING_SECONDS,
        model_label: str = "",
        rooms: bool = True,
        expected: ExpectedMix | None = None,
        schedulers: frozenset[str] | None = None,
        list_budgets: Lister | None = None,
    ) -> None:
        """``rooms``: whether the request mix is told each node's room (only a policy that reads the mix
        uses it; counting 5,000 nodes' rooms for one that does not is a cost on a scheduling call).
        ``schedulers``: the schedulers that call this extender (None: any); a pod for another one is never
        bound here, so no earlier extender can have its Binding in flight (``arm_fence``). ``list_budgets``:
        the PodDisruptionBudgets, for preemption's choice of victims (None: none are read)."""
        self.schedulers = schedulers
        self.owner = Owner()
        self.state = ClusterState(
            resources=resources, clock=clock, model_label=model_label, rooms=rooms, expected=expected
        )
        self.index = FilterIndex(self.state)
        self.state.changed = self.index.changed
        self.reservations = Reservations(clock=clock, landing_seconds=landing_seconds)
        #: when it began watching (``start``): an earlier process's Bindings were all sent before
        self.started: float | None = None
        self.inbox = Inbox(self._apply, self.owner)
        # Short watches: a watch that neither delivers nor ends within watch_seconds + its grace is dead,
        # and is replaced by a relist (Informer.stale).
        self.nodes: Informer[NodeBody] = Informer(
            list_nodes, name="nodes", handler=self.inbox.handler("nodes"), watch_seconds=watch_seconds
        )
        self.pods: Informer[PodBody] = Informer(
            list_pods,
            name="pods",
            handler=self.inbox.handler("pods"),
            transform=slim_pod,
            watch_seconds=watch_seconds,
        )
        #: the PodDisruptionBudgets (``budgets``), watched where ``list_budgets`` is given
        self.budgets = DisruptionBudgets()
        self.budget_informer: Informer[Any] | None = None
        if list_budgets is not None:
            self.budget_informer = Informer(
                list_budgets,
                name="poddisruptionbudgets",
                handler=self.inbox.handler("poddisruptionbudgets"),
                watch_seconds=watch_seconds,
            )
        #: pods waiting for a node, as the watch shows them: what a bind reads its pod from
        self.pending: dict[Key, PodBody] = {}
        #: those of them that use DRA claims: what the claim allocator looks at (``extender.claims.allocator``)
        self.claiming: dict[Key, PodBody] = {}
        #: those of them gated for steering (``steering.Steerer``)
        self.steering: dict[Key, PodBody] = {}
        #: told every pod the watch shows waiting for a node (``priming.Primer``), on the owner's thread
        self.pending_seen: Callable[[PodBody], None] = lambda pod: None

    def start(self) -> None:
        self.started = self.reservations.clock()
        for informer in self._informers():
            informer.start()

    def stop(self) -> None:
        for informer in self._informers():
            informer.stop()

    def _informers(self) -> list[Informer[Any]]:
        found: list[Informer[Any]] = [self.nodes, self.pods]
        return found if self.budget_informer is None else [*found, self.budget_informer]

    def listed(self) -> bool:
        """Whether the node and pod informers have listed: everything they listed is in the inbox or applied.
        The budgets are not waited for: they weigh a preemption's choice, the Eviction API enforces them, and
        an extender whose ServiceAccount may not read them (an older ClusterRole) must still serve."""
        return self.nodes.synced and self.pods.synced

    def stale(self) -> str | None:
        """Why the cache cannot be trusted right now (a watch silent too long, a relist under way after
        the watch was caught lagging), or None."""
        return self.nodes.stale() or self.pods.stale()

    def prepare(self) -> None:
        """Once the informers have listed: apply all they listed, work out every node's room and pricing
        now (``FilterIndex.warm``) and the first request mix, and fence binds for Bindings an earlier
        extender may have left in flight (``arm_fence``)."""
        self.inbox.drain()
        self.index.warm()
        self.state.request_mix()  # the first mix, with every node class's view, before the first verb
        self.arm_fence(since=self.started)  # an earlier process sent its last Binding before this one began

    # --- the informers' changes, applied by the owner ------------------------------------------------------

    def _apply(self, kind: str, old: Any, new: Any) -> None:
        if kind == "pods":
            self.on_pod(old, new)
        elif kind == "poddisruptionbudgets":
            self.budgets.on_budget(old, new)
        else:
            self.on_node(old, new)

    def on_node(self, old: NodeBody | None, new: NodeBody | None) -> None:
        self.owner.check("a node event")
        self.state.on_node(old, new)

    def on_pod(self, old: PodBody | None, new: PodBody | None) -> None:
        self.owner.check("a pod event")
        for key in self.reservations.seen(old, new):
            self.state.remove(key)
        self.state.on_pod(old, new, assumed=self.reservations.holds)
        if old is not None and (new is None or uid_of(old) != uid_of(new)):
            for index in (self.pending, self.claiming, self.steering):
                index.pop(key_of(old), None)
        if new is not None:
            pod_key = key_of(new)
            if awaits_node(new):
                self.pending[pod_key] = new
                spec = new.get("spec") or {}
                if spec.get("resourceClaims"):
                    self.claiming[pod_key] = new
                if has_gate(new, STEER_GATE):
                    self.steering[pod_key] = new
                else:
                    self.steering.pop(pod_key, None)
                self.pending_seen(new)
            else:
                for index in (self.pending, self.claiming, self.steering):
                    index.pop(pod_key, None)

    # --- binds: assume, forget, and what ends a reservation ---------------------------------------------------

    def reserve(
        self,
        name: str,
        pod: PodBody,
        request: PodRequest,
        *,
        policy: Policy,
        now_ns: int,
        held: Callable[[list[GpuVerdict]], list[GpuVerdict]] | None = None,
    ) -> Reservation | Rejected:
        """Choose the pod's GPUs on node ``name`` with ``policy`` and count the pod there at once, with the
        annotations that record the choice; or say why it cannot go there. From the judgement to the count
        nothing else runs: two binds to one node never both take the same memory. ``held``: the verdicts with
        the room held for preemptors taken off (``preempting.Nominations.verdicts``)."""
        self.owner.check("reserve")
        self.inbox.drain(BATCH)  # fresher: a pod deleted or bound by others a moment ago (a relist, at most a batch)
        known = self.reservations.assumed(uid_of(pod))
        if known is not None:
            # Its Binding was created and the watch has not shown it yet: a second one would fail, and
            # counting the pod on another node meanwhile would free the memory it holds on the first.
            return Rejected(f"it is already bound to node {known.node} (the watch has not shown it yet)")
        judged = self.index.judge(name, pod, request)
        if isinstance(judged, Rejected):
            return judged
        verdicts, setting = judged
        if held is not None:
            verdicts = held(verdicts)
        choice = policy.choose(verdicts, request, setting)
        if choice is None:
            return Rejected(f"it does not fit node {name}: {explain(verdicts, gpus=request.gpus)}")
        unit = setting.ledger.inventory.unit
        gpus = [verdict.gpu for verdict in choice]
        carried = annotations_of(pod)
        annotations = bind_annotations(request, gpus, unit=unit, now_ns=now_ns, carried=carried.keys())
        annotated: PodBody = {**pod, "metadata": {**meta_of(pod), "annotations": {**carried, **annotations}}}
        self.assume(annotated, name)
        return Reservation(gpus=gpus, annotations=annotations, unit=unit)

    def assume(self, pod: PodBody, node: str) -> None:
        """Count a pod this extender is binding, until the watch or a read-back shows where it is
        (kube-scheduler's ``AssumePod``)."""
        self.owner.check("assume")
        slim = slim_pod(pod)  # kept as the watch would keep it; its parts may be shared, so copied, not changed
        bound: PodBody = {**slim, "spec": {**slim.get("spec", {}), "nodeName": node}}
        namespace, name = key_of(bound)
        self.reservations.assume(uid_of(bound), namespace, name, node)
        self.state.place(bound)

    def forget(self, pod: PodBody, node: str) -> None:
        """A Binding the API server refused: it never lands, so its reservation goes at once
        (kube-scheduler's ``ForgetPod``)."""
        self.owner.check("forget")
        uid = uid_of(pod)
        if self.reservations.forget(uid, node) and self.state.node_of.get(uid) == node:
            self.state.remove(uid)

    def unanswered(self, pod: PodBody, node: str) -> None:
        """A Binding whose answer was lost (timeout, cut connection, 5xx): it may land yet. Its memory stays
        counted on ``node`` under a key of its own until the pod is read back or seen (``reservations``);
        the pod itself is free to be tried elsewhere meanwhile."""
        self.owner.check("unanswered")
        uid = uid_of(pod)
        if self.state.node_of.get(uid) != node:
            return  # the watch showed the pod already: it is counted where it is
        moved = self.reservations.unanswered(uid, node)
        if moved is None:
            return
        body = self.state.nodes[node].pods[uid]
        self.state.remove(uid)
        self.state.place({**body, "metadata": {**meta_of(body), "uid": moved.key}})

    def due(self, *, limit: int) -> list[Assumed]:
        """Reservations to read back now (``Reservations.due``)."""
        self.owner.check("due")
        return self.reservations.due(limit=limit)

    def settle(self, assumed: Assumed, read: PodBody | None) -> Settlement | None:
        """Apply what a read-back of the pod showed (None: 404); None when the watch settled it meanwhile.

        The inbox is drained first, so a pod the read shows bound that the watch had shown too is settled
        by the watch: reaching COUNT means the watch is behind the API server, and is listed again."""
        self.owner.check("settle")
        self.inbox.drain()
        outcome = self.reservations.settle(assumed, read)
        if outcome is None or outcome.action is Action.WAIT:
            return outcome
        if outcome.action is Action.COUNT:
            assert read is not None
            if self.reservations.lagging():
                self.pods.relist(f"the pod watch has not shown pod {assumed.namespace}/{assumed.name} bound")
            for key in self.reservations.settled(assumed.uid):
                self.state.remove(key)
            self.state.place(slim_pod(read))
        elif assumed.unanswered:
            self.state.remove(assumed.key)
        elif self.state.node_of.get(assumed.uid) == assumed.node:
            self.state.remove(assumed.uid)
        return outcome

    def arm_fence(self, *, since: float | None = None) -> int:
        """Fence binds after a start or a takeover (``reservations.fenced``) for the pods waiting for a node
        whose Binding an earlier extender may have in flight: those it could have placed (pods of the
        schedulers that call it, asking for GPU memory some node has). A pod that fits
        on no node now could not have been: its Binding, if any, would land on memory this cache shows
        free (nothing since has been bound by this extender), and one whose request cannot be read no
        extender binds."""
        self.owner.check("arm the fence")
        names = self.state.node_names()
        fits: dict[tuple[int, int, bool], bool] = {}
        doubtful = set()
        for pod in self.pending.values():
            if uid_of(pod) in self.state.node_of:
                continue  # assumed by this extender
            if self.schedulers is not None and scheduler_of(pod) not in self.schedulers:
                continue  # another scheduler's: no extender of these binds it
            try:
                request = pod_request(pod, resources=self.state.resources)
            except ContractError:
                continue
            if not request.total:
                continue
            shape = (request.per_gpu, request.gpus, request.mps)
            if shape not in fits:
                fits[shape] = bool(self.index.filter(names, request)[0])
            if fits[shape]:
                doubtful.add(uid_of(pod))
        return self.reservations.arm_fence(doubtful, since=since)
