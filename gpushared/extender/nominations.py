"""The GPUs preemption freed, held for their preemptors until they bind.

kube-scheduler keeps a nominated pod's resources on its node for every pod that does not outrank it; it
counts GPU memory per node, so the extender holds the GPUs themselves: those its ``preempt`` verb told
kube-scheduler the preemptor gets there (``preempting``). A pod of lower or equal priority is not placed
into that room meanwhile, by filter or by bind; the preemptor itself gets its offered GPUs at bind. A hold
lasts while the preemptor waits with that node nominated (``status.nominatedNodeName``), and at most
``HOLD_SECONDS``. The offers are the leader's memory only: after a takeover the new leader holds nothing
until kube-scheduler preempts again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpushared.core.placement.nodes import NodeState
from gpushared.core.shared.bodies import PodBody, priority_of, uid_of
from gpushared.core.shared.ledger import GpuVerdict, Holding, Ledger
from gpushared.core.shared.requests import PodRequest
from gpushared.core.shared.verdicts import fitting, judge

#: The longest the GPUs freed for a preemptor are held for it: its victims' grace periods (30 s by default)
#: and its next scheduling attempt fit in well within it; past it, the room is anyone's.
HOLD_SECONDS = 300.0
#: The most preemptors with offers kept: each offer is a few numbers per node kube-scheduler proposed.
MAX_OFFERED = 10_000


@dataclass(frozen=True)
class Offer:
    """What the extender told kube-scheduler a preemptor gets on one node once its victims are gone."""

    gpus: tuple[int, ...]
    per_gpu: int
    compute: int
    priority: int
    at: float
    #: the extender evicted the victims itself (``evictions``): held whether or not kube-scheduler nominated
    #: the node, unless it nominated another
    evicted: bool = False


class Nominations:
    """The GPUs freed for preemptors, by preemptor UID and node; held while the preemptor waits nominated
    there (the cache's pending pods say so), so no lower-priority pod is placed into them meanwhile."""

    def __init__(
        self, pending: Callable[[], Iterable[PodBody]], nodes: Mapping[str, NodeState], clock: Callable[[], float]
    ) -> None:
        """``pending``: the pods waiting for a node, as the cache shows them; ``nodes``: the cache's nodes."""
        self.pending, self.nodes, self.clock = pending, nodes, clock
        self.offers: dict[str, dict[str, Offer]] = {}

    def offer(self, uid: str, node: str, offer: Offer) -> None:
        if uid not in self.offers and len(self.offers) >= MAX_OFFERED:
            self.prune()
            if len(self.offers) >= MAX_OFFERED:
                self.offers.pop(next(iter(self.offers)))  # the oldest preemptor's
        self.offers.setdefault(uid, {})[node] = offer

    def prune(self) -> None:
        """Drop the offers of preemptors that no longer wait, and those past ``HOLD_SECONDS``."""
        now = self.clock()
        waiting = {uid_of(pod) for pod in self.pending()}
        for uid in list(self.offers):
            kept = {n: o for n, o in self.offers[uid].items() if now - o.at < HOLD_SECONDS}
            if uid in waiting and kept:
                self.offers[uid] = kept
            else:
                del self.offers[uid]

    def held(self, node: str, *, for_pod: PodBody) -> list[tuple[str, Offer]]:
        """The holds on ``node`` that ``for_pod`` must leave alone: other preemptors', waiting with the node
        nominated, of at least its priority."""
        if not self.offers:
            return []
        uid, priority, now = uid_of(for_pod), priority_of(for_pod), self.clock()
        found = []
        for pod in self.pending():
            other = uid_of(pod)
            offer = self.offers.get(other, {}).get(node)
            if offer is None or other == uid or now - offer.at >= HOLD_SECONDS:
                continue
            nominated = (pod.get("status") or {}).get("nominatedNodeName")
            held = nominated == node or (offer.evicted and not nominated)
            if held and offer.priority >= priority:
                found.append((other, offer))
        return found

    def own(self, node: str, pod: PodBody) -> Offer | None:
        """The preemptor's own offer on ``node``, while it holds."""
        offer = self.offers.get(uid_of(pod), {}).get(node)
        return offer if offer is not None and self.clock() - offer.at < HOLD_SECONDS else None

    def verdicts(self, node: str, pod: PodBody, verdicts: list[GpuVerdict], request: PodRequest) -> list[GpuVerdict]:
        """``verdicts`` judged again with the room held for other preemptors counted, and for a preemptor its own
        offered GPUs alone where they all still fit: what bind chooses from."""
        held = self._with_holds(node, pod)
        judged = verdicts if held is None else judge(held, request)
        own = self.own(node, pod)
        if own is not None:
            mine = [v for v in judged if v.gpu.index in own.gpus and v.fits]
            if len(mine) >= request.gpus:
                return mine
        return judged

    def fits(self, node: str, pod: PodBody, request: PodRequest) -> bool:
        """Whether the pod still fits ``node`` with the room held for other preemptors counted."""
        held = self._with_holds(node, pod)
        return held is None or len(fitting(held, request)) >= request.gpus

    def _with_holds(self, node: str, pod: PodBody) -> Ledger | None:
        """The node's ledger with the room held there for other preemptors ``pod`` must leave alone counted as
        ``kept`` holdings (memory and compute, never pods), judged as the filter judges; None where nothing is
        held there (or the node has no ledger: the filter said why already)."""
        holds = self.held(node, for_pod=pod)
        state = self.nodes.get(node)
        if not holds or state is None or state.ledger is None:
            return None
        kept = [
            Holding(
                uid=f"held-for/{uid}",
                namespace="",
                name="",
                gpus=dict.fromkeys(offer.gpus, offer.per_gpu),
                compute=offer.compute,
                kept=True,
            )
            for uid, offer in holds
        ]
        return Ledger.build(state.ledger.inventory, [*state.ledger.holdings(), *kept])
