"""The extender's view of the cluster, fed by informers, never by requests; three parts under one lock.

- ``state.ClusterState``: what the informers show — each gpushared node's ledger, CPU and pods, and the
  mix of what pods ask for — through the core's single definition of what a pod holds;
- ``reserving.Reservations``: binds counted before the watch shows them, until evidence (the watch, a
  read-back) says where the pod is: the fixes for stalled watches and Bindings that land late;
- ``index.FilterIndex``: what filter and prioritize read — rooms, reasons and ranks per node, kept until
  the node's ledger changes.

``ClusterCache`` wires them to the two informers and is what the scheduler and the HTTP routes hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gpushared.contract import ContractError, GpuInventory, ResourceNames
from gpushared.core.bodies import NodeBody, PodBody, awaits_node, slim_pod, uid_of
from gpushared.core.fragmentation import RequestMix
from gpushared.core.ledger import Holding
from gpushared.core.policies import NodeRank, Policy, PricingContext
from gpushared.core.requests import PodRequest, pod_request
from gpushared.core.verdicts import GpuVerdict
from gpushared.extender.index import FilterIndex
from gpushared.extender.reservations import LANDING_SECONDS, Assumed, Settlement
from gpushared.extender.reserving import Reservation, Reservations
from gpushared.extender.state import MIX_SECONDS, ClusterState, Rejected
from gpushared.kube.informer import Informer
from gpushared.kube.rest import Lister

__all__ = ["MIX_SECONDS", "ClusterCache", "Rejected", "Reservation"]


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
    ) -> None:
        """``rooms``: whether the request mix is told each node's room (only a policy that reads the mix
        uses it; counting 5,000 nodes' rooms for one that does not is a cost on a scheduling call)."""
        self.state = ClusterState(resources=resources, clock=clock, model_label=model_label, rooms=rooms)
        self.index = FilterIndex(self.state)
        self.state.changed = self.index.changed
        # Short watches: a watch that neither delivers nor ends within watch_seconds + its grace is dead,
        # and is replaced by a relist (Informer.stale).
        self.nodes: Informer[NodeBody] = Informer(
            list_nodes, name="nodes", handler=self.state.on_node, watch_seconds=watch_seconds
        )
        self.pods: Informer[PodBody] = Informer(
            list_pods, name="pods", handler=self._on_pod, transform=slim_pod, watch_seconds=watch_seconds
        )
        self.reservations = Reservations(
            self.state, self.index, watch_lags=self.pods.relist, landing_seconds=landing_seconds
        )
        #: told every pod the watch shows waiting for a node, on the informer's thread (``priming.Primer``)
        self.pending_seen: Callable[[PodBody], None] = lambda pod: None

    def start(self) -> None:
        self.nodes.start()
        self.pods.start()

    def stop(self) -> None:
        self.nodes.stop()
        self.pods.stop()

    def stale(self) -> str | None:
        """Why the cache cannot be trusted right now (a watch silent too long, a relist under way after
        the watch was caught lagging), or None."""
        return self.nodes.stale() or self.pods.stale()

    def _on_pod(self, old: PodBody | None, new: PodBody | None) -> None:
        with self.state.lock:
            self.reservations.seen(old, new)
            self.state.on_pod(old, new, assumed=self.reservations.holds)
        if new is not None and awaits_node(new):
            self.pending_seen(new)

    # --- the verbs' reads (index) and the cluster as it is (state) -------------------------------------------

    def judge(self, name: str, pod: PodBody, request: PodRequest) -> tuple[list[GpuVerdict], PricingContext] | Rejected:
        return self.index.judge(name, pod, request)

    def filter(self, names: list[str], request: PodRequest) -> tuple[list[str], dict[str, str]]:
        return self.index.filter(names, request)

    def node_ranks(self, names: list[str], pod: PodBody, request: PodRequest, policy: Policy) -> list[NodeRank | None]:
        return self.index.node_ranks(names, pod, request, policy)

    def idle_prices(self, names: list[str]) -> list[float]:
        return self.index.idle_prices(names)

    def warm(self) -> None:
        self.index.warm()

    def request_mix(self) -> RequestMix:
        return self.state.request_mix()

    def snapshot(self, name: str) -> tuple[GpuInventory, list[Holding], str] | None:
        return self.state.snapshot(name)

    def node_names(self) -> list[str]:
        return self.state.node_names()

    @property
    def allocation_edits(self) -> int:
        return self.state.allocation_edits

    @property
    def unreadable_pods(self) -> int:
        return len(self.state.unreadable)

    # --- binds (reservations) -----------------------------------------------------------------------------

    def reserve(
        self, name: str, pod: PodBody, request: PodRequest, *, policy: Policy, now_ns: int
    ) -> Reservation | Rejected:
        return self.reservations.reserve(name, pod, request, policy=policy, now_ns=now_ns)

    def assume(self, pod: PodBody, node: str) -> None:
        self.reservations.assume(pod, node)

    def forget(self, pod: PodBody, node: str) -> None:
        self.reservations.forget(pod, node)

    def unanswered(self, pod: PodBody, node: str) -> None:
        self.reservations.unanswered(pod, node)

    def due(self, *, limit: int) -> list[Assumed]:
        return self.reservations.due(limit=limit)

    def settle(self, assumed: Assumed, read: PodBody | None) -> Settlement | None:
        """Apply what a read-back of the pod showed (None: 404); None when the watch settled it meanwhile."""
        # What the watch shows is read first, outside the cache's lock: the pod informer holds its own lock
        # while its handler waits for the cache's, and the other order deadlocked them (issue #39). The
        # watch showing the pod in between settles it there (``settle`` then answers None).
        shown = self.pods.get(assumed.namespace, assumed.name)
        return self.reservations.settle(assumed, read, shown=shown)

    def unconfirmed(self) -> int:
        return self.reservations.unconfirmed()

    def arm_fence(self) -> int:
        """Fence binds after a start or a takeover (``reservations.fenced``) for the pods waiting for a node
        whose Binding an earlier extender may have in flight: those it could have placed. A pod that fits
        on no node now could not have been: its Binding, if any, would land on memory this cache shows
        free (nothing since has been bound by this extender), and one whose request cannot be read no
        extender binds. The watch's pods are read first, outside the cache's lock (the lock order)."""
        names = self.state.node_names()
        fits: dict[tuple[int, int, bool], bool] = {}
        doubtful = set()
        for pod in self.pods.objects():
            if not awaits_node(pod):
                continue
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
        return self.reservations.arm_fence(doubtful)

    def fenced(self) -> str | None:
        return self.reservations.fenced()
