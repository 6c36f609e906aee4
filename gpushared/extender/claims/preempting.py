"""Preemption for the pods the claim allocator holds gated: the lower-priority pods whose claims hold the room
evicted, and the room held for the preemptor until it is allocated.

kube-scheduler never preempts for a gated pod: a pod with scheduling gates is not in its queue. And from 1.34
through 1.36 its preemption frees no DRA device for any pod: the DynamicResources plugin has no
``AddPod``/``RemovePod``, so its dry run with the victims taken off a node still sees their claims
allocated, and a pod short of devices finds no candidate node (its ``PostFilter`` only deallocates a claim
of the pod itself that no pod has reserved). So the allocator preempts for the pods it gates, and only while
they are gated: kube-scheduler never sees them then, and once the gate is gone the allocator never preempts
for that pod again. The two never evict for the same pod.

1. A gated pod whose claims fit no node (the placer's ``NoRoom``, not the room kept for kube-scheduler's
   pods), that may preempt (``preemptionPolicy`` is not ``Never``), gated ``GRACE_SECONDS``: room that frees
   by itself meanwhile costs no one a pod.
2. On at most ``MAX_NODES_TRIED`` of the nodes it may go to (the placer's candidates: its node selection,
   CPU and memory allow them), the pods to evict (``core.placement.claims.preemption.claim_victims``); the
   node picked as kube-scheduler picks one (``core.placement.preemption.pick_node``).
3. The GPUs it gets are held for it (:meth:`ClaimPreempter.held_for`): no pod of lower or equal priority is
   placed into that room until the preemptor's claims are allocated, it is gone, or ``HOLD_SECONDS`` pass.
4. The victims are evicted through the Eviction API, which enforces PodDisruptionBudgets: a 429 drops the
   hold, and the pod is tried again after ``RETRY_SECONDS``. Each victim and the preemptor are told why.

Where pods already terminating free the room (evictions that landed, this leader's or a previous one's),
no one more is evicted: the room is held and the pod waits for it. Evictions count toward the cap of the
preemptor's namespace (``extender.evictioncap``), with the ``preempt`` verb's and the extender's own.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpushared.core.dra.allocated import reserved_pods
from gpushared.core.placement.claims.asks import ClaimAsk
from gpushared.core.placement.claims.preemption import ClaimPod, ClaimVictims, claim_victims, claims_request
from gpushared.core.placement.claims.room import NO_ROOM_KEPT, KeptRoom, Room, added
from gpushared.core.placement.preemption import NodeVictims, Victims, pick_node
from gpushared.core.shared.bodies import PodBody, key_of, meta_of, priority_of, uid_of
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.requests import PodRequest
from gpushared.extender.evicting import Evicted, evict_victims

if TYPE_CHECKING:  # what the allocator hands it: its own, on its loop
    from gpushared.extender.cache import ClusterCache
    from gpushared.extender.claims.cache import ClaimCache
    from gpushared.extender.claims.placing import ClaimPlacer
    from gpushared.extender.events import Event
    from gpushared.extender.evictioncap import EvictionCap
    from gpushared.kube.aioapi import AsyncApi

log = logging.getLogger(__name__)

#: How long a pod is gated with no room before pods are evicted for it.
GRACE_SECONDS = 5.0
#: How long a pod for which no node had victims (or whose eviction was refused) waits before it is looked at again.
RETRY_SECONDS = 10.0
#: The most nodes searched for one pod (kube-scheduler's preemption tries at least 100).
MAX_NODES_TRIED = 100
#: Searches kept at most (each a node's answer for one kind of preemptor); past it they are all made again.
MAX_SEARCHES_KEPT = 100_000
#: The longest the room freed for a preemptor is held for it: its victims' grace periods (30 s by default),
#: their claims' deletion and its allocation fit well within it; past it, the room is anyone's.
HOLD_SECONDS = 300.0


@dataclass(frozen=True)
class Hold:
    """The room on one node held for a preemptor, and for how long."""

    node: str
    room: Mapping[int, Room]
    priority: int
    at: float
    #: how many pods were evicted for it (0: pods already terminating free the room)
    evicted: int


@dataclass(frozen=True)
class Preemption:
    """What the allocator does for a pod no node has room for: the node, the pods to evict there (none: the
    room is on its way), and the room held."""

    node: str
    victims: ClaimVictims
    request: PodRequest


class ClaimPreempter:
    """Owned by the claim allocator, on its event loop; every decision is made in ``plan`` (no I/O), and
    ``evict`` carries one out."""

    def __init__(
        self,
        cache: ClusterCache,
        claim_cache: ClaimCache,
        placer: ClaimPlacer,
        api: AsyncApi,
        *,
        cap: EvictionCap,
        clock: Callable[[], float],
        event: Event,
        spawn: Callable[[Awaitable[None]], None],
    ) -> None:
        self.cache, self.claim_cache, self.placer, self.api = cache, claim_cache, placer, api
        self.cap, self.clock, self.event, self.spawn = cap, clock, event, spawn
        #: preemptor UID -> the room held for it
        self.holds: dict[str, Hold] = {}
        #: preemptor UID -> when it was last looked at and got nothing (looked at again after RETRY_SECONDS)
        self.tried: dict[str, float] = {}
        #: what happened: evicted, refused (a PodDisruptionBudget), gone, failed (a pod), capped, coming (room
        #: held that pods already terminating free), no_victims (a preemptor no node had victims for)
        self.counts: Counter[str] = Counter()
        self._cursor = 0
        #: (the claim cache's change count, the lowest priority of a pod holding a claim): a pod of no higher
        #: priority has no victims anywhere, and is not searched for
        self._lowest: tuple[int, int | None] = (-1, None)
        #: (node, request, priority, the budgets' version) -> (the node's ledger, weakly, and its version; what
        #: the search found): pods alike waiting for room search each node once while its claims stay the same
        self._searched: dict[
            tuple[str, PodRequest, int, int], tuple[weakref.ref[Ledger], int, ClaimVictims | None]
        ] = {}

    # --- reads ---------------------------------------------------------------------------------------------

    def hold_of(self, uid: str) -> Hold | None:
        hold = self.holds.get(uid)
        if hold is not None and self.clock() - hold.at >= HOLD_SECONDS:
            del self.holds[uid]
            return None
        return hold

    def held_for(self, pod: PodBody) -> KeptRoom:
        """The room held for other preemptors that ``pod`` must leave alone: those of at least its priority
        (kube-scheduler's nominated pods too keep their room from every pod that does not outrank them)."""
        if not self.holds:
            return NO_ROOM_KEPT
        uid, priority, now = uid_of(pod), priority_of(pod), self.clock()
        held: KeptRoom = NO_ROOM_KEPT
        for other, hold in self.holds.items():
            if other != uid and hold.priority >= priority and now - hold.at < HOLD_SECONDS:
                held = added(held, {hold.node: hold.room})
        return held

    # --- deciding (no I/O) ---------------------------------------------------------------------------------

    def may_preempt(self, pod: PodBody, now: float, gated_since: float) -> bool:
        """Whether pods may be evicted for the gated pod now."""
        uid = uid_of(pod)
        if (pod.get("spec") or {}).get("preemptionPolicy") == "Never" or self.hold_of(uid) is not None:
            return False
        if now - gated_since < GRACE_SECONDS or now - self.tried.get(uid, -RETRY_SECONDS) < RETRY_SECONDS:
            return False
        lowest = self._lowest_priority()
        return lowest is not None and lowest < priority_of(pod)

    def _lowest_priority(self) -> int | None:
        """The lowest priority of the pods the claims allocated on the nodes are reserved for (None: none),
        worked out again only when a claim changed."""
        if self._lowest[0] != self.claim_cache.changes:
            pods = _BoundPods(self.cache)
            priorities = [
                pods[ref.uid].priority
                for node in self.claim_cache.published()
                for claim in self.claim_cache.allocated_on(node)
                for ref in reserved_pods(claim)
                if ref.uid in pods
            ]
            self._lowest = (self.claim_cache.changes, min(priorities, default=None))
        return self._lowest[1]

    def plan(
        self, pod: PodBody, asks: Sequence[ClaimAsk], fixed: str | None, now: float, *, budget: float
    ) -> Preemption | str:
        """The node to preempt on and its victims, or why there is none: at most MAX_NODES_TRIED nodes, from
        where the last search stopped, and past ``budget`` (a ``time.perf_counter`` deadline: the allocator's
        step) the best of those tried so far, as kube-scheduler too chooses among a sample. A plan is counted
        at once: its room held, its evictions counted toward the cap (``evict`` then carries it out)."""
        uid, priority, namespace = uid_of(pod), priority_of(pod), key_of(pod)[0]
        self.tried[uid] = now
        candidates = self.placer.candidates(self.placer.ask_of(pod, asks, fixed))
        options: list[NodeVictims] = []
        found_on: dict[str, tuple[PodRequest, ClaimVictims]] = {}
        why = "no node has lower-priority pods whose eviction frees the room"
        start = self._cursor % len(candidates) if candidates else 0
        tried = candidates[start:] + candidates[:start]
        searched = 0
        for candidate in tried[:MAX_NODES_TRIED]:
            if searched and time.perf_counter() > budget:
                break
            searched += 1
            request = claims_request(asks, candidate.ledger.unit)
            if isinstance(request, str):
                return f"nothing is evicted for it: {request}"
            found = self._search(candidate.name, candidate.ledger, request, priority, frozenset(candidate.devices))
            if found is None:
                continue
            found_on[candidate.name] = (request, found)
            victims = Victims(found.pods, found.gpus, found.highest, found.pdb_violations)
            options.append(NodeVictims(candidate.name, victims, found.priorities))
        self._cursor = start + searched
        chosen = pick_node(options)
        if chosen is None:
            self.counts["no_victims"] += 1
            return why
        if chosen.victims.uids and not self.cap.may_evict(namespace, now):
            self.counts["capped"] += 1
            return f"namespace {namespace} had its most pods evicted for it this minute"
        request, found = found_on[chosen.node]
        room = {index: Room(request.per_gpu, request.compute_request) for index in found.gpus}
        self.holds[uid] = Hold(chosen.node, room, priority, now, len(found.pods))
        if found.pods:
            self.cap.count(namespace, now, len(found.pods))
        else:
            self.counts["coming"] += 1
        self.tried.pop(uid, None)
        return Preemption(chosen.node, found, request)

    def _search(
        self, node: str, ledger: Ledger, request: PodRequest, priority: int, published: frozenset[int]
    ) -> ClaimVictims | None:
        """``claim_victims`` on the node, kept while the node's ledger is the same object at the same version
        (a claim changed, reserved or released, or a pod reserving one came or went: a new ledger)."""
        key = (node, request, priority, self.cache.budgets.version)
        known = self._searched.get(key)
        if known is not None and known[0]() is ledger and known[1] == ledger.version and self._standing(known[2]):
            return known[2]
        found = claim_victims(
            ledger,
            request,
            priority=priority,
            claims=self._reserved(node),
            pods=self._pods(),
            published=published,
            pdb_allowed=self.cache.budgets.allowed(),
        )
        if len(self._searched) >= MAX_SEARCHES_KEPT:
            self._searched.clear()
        self._searched[key] = (weakref.ref(ledger), ledger.version, found)
        return found

    def _standing(self, found: ClaimVictims | None) -> bool:
        """Whether the victims a kept search found are all still there and not terminating (a pod deleted
        meanwhile changes no claim until it is gone)."""
        if found is None:
            return True
        pods = self._pods()
        return all(uid in pods and not pods[uid].terminating for uid in found.pods)

    def _reserved(self, node: str) -> dict[str, tuple[str, ...]]:
        """Claim UID -> the pods it is reserved for, of the claims allocated on ``node``."""
        return {
            uid_of(claim): tuple(ref.uid for ref in reserved_pods(claim))
            for claim in self.claim_cache.allocated_on(node)
        }

    def _pods(self) -> Mapping[str, ClaimPod]:
        """Pod UID -> what the choice reads of it, for the pods bound to a node (looked up lazily)."""
        return _BoundPods(self.cache)

    # --- acting (the API calls) ----------------------------------------------------------------------------

    async def evict(self, pod: PodBody, preemption: Preemption) -> None:
        """Evict the victims one by one; one a PodDisruptionBudget protects stops the rest, and the hold goes."""
        key, uid, node = key_of(pod), uid_of(pod), preemption.node
        victims = preemption.victims
        gpus = ",".join(map(str, victims.gpus))
        if not victims.pods:
            log.info("pod %s/%s: pods terminating on node %s free GPU %s for it: nothing evicted", *key, node, gpus)
            return
        why = (
            f"on node {node} evicted by gpushared's claim allocator for pod {key[0]}/{key[1]} (priority "
            f"{priority_of(pod)}), whose claims need GPU {gpus} there"
        )
        bodies = self.cache.state.nodes[node].pods if node in self.cache.state.nodes else {}
        evicted = await evict_victims(
            self.api,
            victims.pods,
            bodies,
            preemptor=key,
            why=why,
            counts=self.counts,
            event=self.event,
            spawn=self.spawn,
        )
        if evicted is Evicted.REFUSED:  # nothing went, the room is not coming: looked at again after the retry
            self.holds.pop(uid, None)
            self.tried[uid] = self.clock()
        if evicted is not Evicted.ALL:  # one that failed otherwise may have landed: the hold stays
            return
        message = f"evicted {len(victims.pods)} pod(s) on node {node} for its claims: GPU {gpus} is held for it"
        self.spawn(self.event(pod, "Preempting", message))

    # --- forgetting ----------------------------------------------------------------------------------------

    def done(self, uid: str) -> None:
        """The preemptor's claims are allocated (or it is handed over): its room is its own now."""
        self.holds.pop(uid, None)
        self.tried.pop(uid, None)

    def forget_gone(self, waiting: set[str]) -> None:
        """Drop what is kept for preemptors no longer waiting: bounded by the pods waiting."""
        for kept in (self.holds, self.tried):
            for uid in [u for u in kept if u not in waiting]:
                del kept[uid]


class _BoundPods(Mapping[str, ClaimPod]):
    """The pods bound to nodes, as the claim choice reads them, looked up in the cache by UID on demand."""

    def __init__(self, cache: ClusterCache) -> None:
        self.state, self.budgets = cache.state, cache.budgets

    def __getitem__(self, uid: str) -> ClaimPod:
        node = self.state.node_of.get(uid)
        pod = self.state.nodes[node].pods.get(uid) if node is not None and node in self.state.nodes else None
        if pod is None:
            raise KeyError(uid)
        terminating = bool(meta_of(pod).get("deletionTimestamp"))
        return ClaimPod(priority_of(pod), terminating=terminating, pdbs=self.budgets.of(pod))

    def __iter__(self) -> Any:
        return iter(self.state.node_of)

    def __len__(self) -> int:
        return len(self.state.node_of)
