"""The claim allocator: gpushared's policies for DRA claims, in front of kube-scheduler.

kube-scheduler by itself allocates a claim first fit on a node its default scores chose. gpushared's
webhook holds every new pod that uses a claim of gpushared's DeviceClass back with a scheduling gate
(``core.placement.claims.gate.CLAIM_GATE``); the leader's allocator, on the extender's event loop:

1. reads each gated pod's claims from its cache (``claims.cache.ClaimCache``; ``core.placement.claims.pods.read_pod``);
2. chooses the node and devices with the extender's policy over the same ledgers
   (``core.placement.claims.choice``), and counts the choice at once (assume), before any write;
3. writes each claim's ``status.allocation`` (``core.dra.allocation``), guarded by the resourceVersion it
   read: a claim changed meanwhile, or written by a second allocator, fails with 409 and nothing is taken;
4. removes the gate, with a JSON Patch that tests the pod's UID and the gate's place: kube-scheduler then
   keeps the pod to the allocation's node (its PreFilter), reserves the claims and binds it.

Fail closed: a pod stays gated while no node has room, or while the allocator is down or not leading. The
opt-in ``handover_after`` removes the gate of a pod gated that long, with no allocation, leaving it to
kube-scheduler's first fit (counted, logged and told in an Event). A pod whose claims the allocator does not
place (another driver's pending claim, CEL selectors, ...) is handed over at once, saying why. A pod
deleted after its claims were written and before its gate went has them released (the allocation removed,
resourceVersion-guarded), unless a pod has reserved them meanwhile.

Nothing here holds a lock, and nothing it owns is touched off the loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpushared.contract import dra
from gpushared.core.placement.claims.asks import ClaimAsk
from gpushared.core.placement.claims.choice import ClaimChoice, NoRoom, holdings_of
from gpushared.core.placement.claims.gate import CLAIM_GATE
from gpushared.core.placement.claims.pods import read_pod
from gpushared.core.placement.policies import Policy
from gpushared.core.shared.bodies import Key, ObjectBody, PodBody, has_gate, key_of, uid_of, version_of
from gpushared.extender.cache import ClusterCache
from gpushared.extender.claims.cache import ClaimCache
from gpushared.extender.claims.fence import FENCED, ClaimFence
from gpushared.extender.claims.placing import ClaimPlacer
from gpushared.extender.claims.preempting import ClaimPreempter, Preemption
from gpushared.extender.claims.writes import ClaimWrites, Gate, refused_permission
from gpushared.extender.events import Event, no_event, pod_events
from gpushared.extender.evictioncap import EvictionCap
from gpushared.extender.gatedwork import GatedPodWorker
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.api import Api
from gpushared.kube.errors import KubeError

log = logging.getLogger(__name__)

#: How long one step decides pods before it lets the event loop run the rest (the webhook, /healthz, writes).
STEP_SECONDS = 0.02
#: The outcomes that leave a pod's claims of this driver to kube-scheduler's first fit.
HANDED_OVER = ("handover", "timeout")
#: The Event a waiting pod is told when the API server refuses the allocator a permission (a warning).
REFUSED_EVENT = "ClaimAllocationRefused"
#: Who Events on pods say they come from.
COMPONENT = "gpushared-claim-allocator"
#: How often the leader looks at the gated pods.
TICK_SECONDS = 0.1
#: How long after the allocator's last write a pod is handed over to kube-scheduler: kube-scheduler's claim
#: informer must show every allocation of the allocator before it allocates a claim of the same driver itself.
QUIET_SECONDS = 2.0
#: How long the allocator waits for its claim watch to show the allocations it wrote before it removes the
#: pod's gate: kube-scheduler's claim watch shows them about as soon, and one told of the pod first allocates
#: the claims itself, is refused, and tries the pod again seconds later. Past it the gate goes anyway.
SHOWN_WITHIN_SECONDS = 1.0


@dataclass(frozen=True)
class AllocatorSettings:
    policy: Policy
    driver: str = dra.DRIVER
    device_class: str = dra.DEVICE_CLASS
    #: seconds a pod may stay gated before its gate is removed with no allocation (None: never, fail closed)
    handover_after: float | None = None
    #: the DeviceClass's ``spec.config``, copied into each allocation (source FromClass)
    class_config: tuple[dict[str, Any], ...] = ()
    #: the node label naming GPU models, as the extender's (""; models not weighed)
    model_label: str = ""


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Ungate:
    reason: str
    #: why: "allocated" (nothing left to allocate), "handover" (left to kube-scheduler), "timeout"
    outcome: str


@dataclass(frozen=True)
class Allocate:
    choice: ClaimChoice
    asks: tuple[ClaimAsk, ...]


@dataclass(frozen=True)
class Preempt:
    """Pods of lower priority evicted for the pod (or already terminating), the room held for it meanwhile."""

    preemption: Preemption

    @property
    def reason(self) -> str:
        found, node = self.preemption.victims, self.preemption.node
        gpus = ",".join(map(str, found.gpus))
        if not found.pods:
            return f"pods terminating on node {node} free GPU {gpus} for it: held for it until then"
        return f"{len(found.pods)} pod(s) of lower priority evicted on node {node} to free GPU {gpus}: held for it"


def claim_events(api: Api) -> Event:
    """The allocator's Events on pods: waiting is Normal, every other a Warning."""
    return pod_events(
        api, component=COMPONENT, normal=frozenset({"WaitingForClaimAllocator", "Preempted", "Preempting"})
    )


class ClaimAllocator(GatedPodWorker):
    def __init__(
        self,
        cache: ClusterCache,
        claim_cache: ClaimCache,
        api: AsyncApi,
        settings: AllocatorSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        event: Event = no_event,
        rng: random.Random | None = None,
        cap: EvictionCap | None = None,
    ) -> None:
        """``cap``: the evictions for preemptors per namespace, shared with the extender's other paths (None:
        the allocator's own, at the default)."""
        super().__init__(clock)
        self.cache, self.claim_cache, self.api, self.settings = cache, claim_cache, api, settings
        self.event = event
        self.rng = rng or random.Random()
        #: pod UID -> why it waits, as last told (a reason changes: told again)
        self.told: dict[str, str] = {}
        #: what happened, for the metrics: allocated, handover, timeout, conflict, released, not_gated,
        #: not_ours, refused (``metrics.ClaimAllocations.OUTCOMES``)
        self.counts: Counter[str] = Counter()
        self.writes = ClaimWrites(cache, claim_cache, api, driver=settings.driver, class_config=settings.class_config)
        self.placer = ClaimPlacer(cache, claim_cache, settings.policy, model_label=settings.model_label, rng=self.rng)
        #: evicts lower-priority pods for gated pods that fit nowhere, and holds the room they free
        self.preempter = ClaimPreempter(
            cache, claim_cache, self.placer, api, cap=cap or EvictionCap(), clock=clock, event=event, spawn=self.spawn
        )
        #: when the allocator last wrote an allocation (the quiet period before a hand-over)
        self.last_write = float("-inf")
        #: where in the gated pods the next step starts deciding, and how many the last step left undecided
        self._cursor = 0
        self.undecided = 0
        #: pods decided since the last step that started a write: past a whole turn of the gated pods with
        #: nothing started, the loop waits a tick before the next step instead of running them again at once
        self.idle_decisions = 0
        self._last_decided = 0
        #: kube-scheduler's pods: the room the allocator keeps free for them meanwhile, the pods it counts not gated
        self.fence = ClaimFence(
            lambda namespace: claim_cache.claims.get(namespace, {}),
            self.placer,
            device_class=settings.device_class,
            counts=self.counts,
            told=self._not_gated_event,
        )
        self._led = False
        #: when the current step stops deciding (a preemption's search stops there too)
        self._budget = float("inf")

    # --- the loop ------------------------------------------------------------------------------------------

    async def run(self, *, leading: Callable[[], bool], ready: Callable[[], bool]) -> None:
        """Step while this replica leads and its cache is ready. Each step decides for at most STEP_SECONDS;
        one that left pods undecided is followed by the next as soon as the loop has run what waited, unless
        a whole turn of the gated pods started nothing (they all wait for room): then a tick passes first, so
        that pods waiting for room never keep a core busy."""
        while True:
            more = False
            leads = leading() and ready()
            if leads and not self._led:
                self.fence.began_leading(self.cache.claiming.values())
            self._led = leads
            if leads:
                self.step()
                more = self.undecided > 0 and self.idle_decisions < self.undecided + self._last_decided
            await asyncio.sleep(0 if more else TICK_SECONDS)

    def step(self) -> int:
        """Decide the gated pods not in flight (for at most STEP_SECONDS: ``undecided`` says how many are left
        to the next step), start what must be written, release what is left over. Returns how many pods it
        started writing for."""
        self.cache.owner.check("the claim allocator's step")
        self.cache.inbox.drain()
        self.claim_cache.drain()
        started = 0
        now = self.clock()
        gated = []
        self.fence.clear()
        for key, pod in list(self.cache.claiming.items()):  # pending pods that use claims: never all pods
            if key in self.inflight:
                continue
            if has_gate(pod, CLAIM_GATE):
                gated.append((key, pod))
            else:
                self.fence.look_at(key, pod, now, gated_before=uid_of(pod) in self.first_seen)
        if gated:  # the room kept for kube-scheduler, worked out only when a pod is to be placed
            self.fence.hold()
        budget = self._budget = time.perf_counter() + STEP_SECONDS
        start = self._cursor % len(gated) if gated else 0
        decided = 0
        refused = self.writes.refusals.holding(now)
        for key, pod in gated[start:] + gated[:start]:  # from where the last step stopped: no pod starves
            if time.perf_counter() > budget:
                break  # the rest at the next step: the loop serves the webhook and /healthz between them
            decided += 1
            self.first_seen.setdefault(uid_of(pod), now)
            started += self._act(key, pod, self.decide(pod, now), now, refused=refused)
        self._cursor = start + decided
        self.undecided = len(gated) - decided
        self._last_decided = decided
        self.idle_decisions = 0 if started else self.idle_decisions + decided
        self._release_left_over(now)
        self._forget_gone()
        return started

    def _act(
        self, key: Key, pod: PodBody, decision: Wait | Ungate | Allocate | Preempt, now: float, *, refused: bool
    ) -> int:
        """Start what the pod's decision calls for: 1 where a write started, else 0."""
        if refused and not (isinstance(decision, Ungate) and decision.outcome == "not_ours"):
            self._tell(pod, self.writes.refusals.reason(), event=REFUSED_EVENT)
            return 0
        if isinstance(decision, Wait) and decision.reason == FENCED:
            self.counts["fenced"] += 1
        elif isinstance(decision, Ungate) and decision.outcome in HANDED_OVER and not self._quiet(now):
            decision = Wait("handed over to kube-scheduler once the allocator's last writes are seen")
        if isinstance(decision, Wait | Preempt):
            self._tell(pod, decision.reason)
            if isinstance(decision, Preempt) and decision.preemption.victims.pods:
                self.inflight.add(key)
                self.spawn(self._preempt(pod, decision.preemption))
            return 0
        self.inflight.add(key)
        if isinstance(decision, Allocate):
            self._assume(decision)
            self.spawn(self._allocate(pod, decision))
        else:
            self.spawn(self._ungate(pod, decision))
        return 1

    def _forget_gone(self) -> None:
        """Keep what is kept per pod bounded by the pods waiting: drop what is kept for pods gone."""
        per_pod = (self.first_seen, self.fence.handed_at, self.fence.held_since, self.told, self.preempter.tried)
        waiting = self.cache.claiming
        self.forget_gone(waiting.values(), per_pod, most=5 * len(waiting) + 100)
        if self.preempter.holds:  # a preemptor gone frees its room at once (holds are few)
            self.preempter.forget_gone({uid_of(pod) for pod in waiting.values()})

    def _quiet(self, now: float) -> bool:
        """No allocation of the allocator in flight, and none written in the last QUIET_SECONDS."""
        writing = bool(self.inflight) or bool(self.claim_cache.assumed)
        return not writing and now - self.last_write >= QUIET_SECONDS

    # --- deciding (no I/O) ---------------------------------------------------------------------------------

    def decide(self, pod: PodBody, now: float) -> Wait | Ungate | Allocate | Preempt:
        namespace = key_of(pod)[0]
        read = read_pod(pod, self.claim_cache.claims.get(namespace, {}), device_class=self.settings.device_class)
        if not read.ours:
            return Ungate("none of its claims asks for gpushared's GPUs", "not_ours")
        if read.handover is not None:
            return Ungate(f"handed over to kube-scheduler: {read.handover.reason}", "handover")
        if read.waiting is None and not read.asks:
            return Ungate("its claims of gpushared's GPUs are allocated", "allocated")
        if read.waiting is not None:
            return self._timed_out(pod, now, read.waiting)
        uid = uid_of(pod)
        fenced = self.fence.holds(uid, now)
        preempting = self.preempter.held_for(pod)  # the room freed for preemptors it may not take
        choice = self.placer.choose(pod, read.asks, read.node, fenced=fenced, held=preempting)
        # room only in what kube-scheduler's pods could take: the pod waits
        held = fenced and isinstance(choice, NoRoom)
        held = held and not isinstance(self.placer.choose(pod, read.asks, read.node, held=preempting), NoRoom)
        self.fence.held_back(uid, now, held=held)
        if held:
            return Wait(FENCED)
        if not isinstance(choice, NoRoom):
            return Allocate(choice, read.asks)
        hold = self.preempter.hold_of(uid)
        if hold is not None:
            return Wait(f"{choice.reason}; the room freed for it on node {hold.node} is held for it")
        if self.preempter.may_preempt(pod, now, self.first_seen.get(uid, now)):
            planned = self.preempter.plan(pod, read.asks, read.node, now, budget=self._budget)
            if isinstance(planned, Preemption):
                return Preempt(planned)
            return self._timed_out(pod, now, f"{choice.reason}; {planned}")
        return self._timed_out(pod, now, choice.reason)

    def _timed_out(self, pod: PodBody, now: float, reason: str) -> Wait | Ungate:
        after = self.settings.handover_after
        if after is not None and now - self.first_seen.get(uid_of(pod), now) >= after:
            return Ungate(f"gated {after:g} s and still {reason}: left to kube-scheduler's first fit", "timeout")
        return Wait(reason)

    def _assume(self, decision: Allocate) -> None:
        """Count the choice in the claim cache now: the next pod decided, before any write returns, sees it."""
        holdings = holdings_of(decision.choice, decision.asks)
        for ask in decision.asks:
            mine = [h for h in holdings if h.uid.startswith(f"{ask.uid}/")]
            self.claim_cache.assume(ask.uid, decision.choice.node, mine)

    # --- acting (the API calls) ----------------------------------------------------------------------------

    async def _allocate(self, pod: PodBody, decision: Allocate) -> None:
        key = key_of(pod)
        versions: dict[str, int] = {}
        try:
            for number, ask in enumerate(decision.asks):
                body = self.writes.allocated_body(ask, number, decision.choice)
                if body is None:
                    self._forget(decision.asks[number:])
                    return
                try:
                    written = await self.writes.allocate(body)
                except KubeError as exc:
                    self._forget(decision.asks[number:])
                    if refused_permission(exc):
                        self.counts["refused"] += 1
                        self.writes.refusals.refused(
                            f"the allocation of claim {ask.namespace}/{ask.name}", exc, self.clock()
                        )
                        self._tell(pod, self.writes.refusals.reason(), event=REFUSED_EVENT)
                        return
                    self.counts["conflict"] += 1
                    log.info("claim %s/%s not allocated (tried again): %s", ask.namespace, ask.name, exc)
                    return
                self.writes.refusals.accepted()
                self.claim_cache.written(written)
                self.last_write = self.clock()
                self.writes.written_for[ask.uid] = (key, uid_of(pod), self.last_write, ask)
                versions[ask.uid] = version_of(written)
            await self.claim_cache.until_shown(versions, within=SHOWN_WITHIN_SECONDS)
            await self._ungate(pod, Ungate(f"allocated on node {decision.choice.node}", "allocated"), inflight=False)
        finally:
            self.inflight.discard(key)

    def _forget(self, asks: tuple[ClaimAsk, ...] | list[ClaimAsk]) -> None:
        for ask in asks:
            self.claim_cache.forget(ask.uid)

    async def _ungate(self, pod: PodBody, decision: Ungate, *, inflight: bool = True) -> None:
        key = key_of(pod)
        try:
            gate = await self.writes.remove_gate(pod)
            if gate is Gate.REFUSED and self.writes.refused is not None:
                self.counts["refused"] += 1
                self.writes.refusals.refused(
                    f"the removal of pod {key[0]}/{key[1]}'s gate", self.writes.refused, self.clock()
                )
                self._tell(pod, self.writes.refusals.reason(), event=REFUSED_EVENT)
            if gate is not Gate.REMOVED:
                return  # gone (its claims are released), removed already, refused, or tried again at the next step
            self.counts[decision.outcome] += 1
            self.fence.passed_by_us(uid_of(pod))
            self.preempter.done(uid_of(pod))
            if decision.outcome == "allocated":
                self.waited(uid_of(pod))
            self.told.pop(uid_of(pod), None)
            if decision.outcome == "not_ours":
                log.info("pod %s/%s: %s: ungated", *key, decision.reason)
            elif decision.outcome != "allocated":
                self.fence.handed_at[uid_of(pod)] = self.clock()
                log.warning("pod %s/%s: %s", *key, decision.reason)
                await self.event(pod, "ClaimsHandedOver", decision.reason)
        finally:
            if inflight:
                self.inflight.discard(key)

    def _release_left_over(self, now: float) -> None:
        for claim in self.writes.left_over(now):
            self.spawn(self._release(claim))

    async def _preempt(self, pod: PodBody, preemption: Preemption) -> None:
        try:
            await self.preempter.evict(pod, preemption)
        finally:
            self.inflight.discard(key_of(pod))

    async def _release(self, claim: ObjectBody) -> None:
        if await self.writes.release(claim):
            self.counts["released"] += 1

    # --- telling -------------------------------------------------------------------------------------------

    def _tell(self, pod: PodBody, reason: str, *, event: str = "WaitingForClaimAllocator") -> None:
        uid = uid_of(pod)
        if self.told.get(uid) == reason:
            return
        self.told[uid] = reason
        if event == "WaitingForClaimAllocator":
            log.info("pod %s/%s waits for the claim allocator: %s", *key_of(pod), reason)
        self.spawn(self.event(pod, event, reason))

    def _not_gated_event(self, pod: PodBody) -> None:
        message = "reached kube-scheduler without the claim allocator's gate: its claims are allocated first fit"
        self.spawn(self.event(pod, "ClaimsNotGated", message))
