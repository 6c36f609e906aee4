"""Preemption the extender does itself, for a kube-scheduler that never calls its preempt verb.

kube-scheduler 1.20.0-1.20.8 and 1.21.0-1.21.2 do not call an extender's ``preemptVerb`` at all (their
framework is built without the extenders; kubernetes#103019 fixed it). There, a GPU pod that fits nowhere
would wait for ever, or, where kube-scheduler counts ``aliyun.com/gpu-mem`` per node itself, get pods evicted
that free no GPU: the configuration for them leaves GPU memory to the extender (``ignoredByScheduler: true``).
And on any version, a pod that fits the node's count of GPU memory but no GPU has no victims in
kube-scheduler's dry run, which then asks no one. For those the leader does what the verb would have had
kube-scheduler do:

1. a pending GPU pod of a scheduler that calls this extender, that may preempt (``preemptionPolicy`` is not
   ``Never``), that no node fits (the filter's answer from the cache), and that kube-scheduler has not
   asked the verb about (``Preempter.asked``), pending ``GRACE_SECONDS`` since this leader first saw it;
2. the node is chosen as kube-scheduler chooses among candidates (``core.placement.preemption.pick_node``)
   among the nodes its selection allows, each with the victims the verb would answer there
   (``Preempter.on_node``); at most ``MAX_NODES_TRIED`` nodes, from where the last search stopped;
3. the GPUs it gets are held for it (``nominations``), and the victims are evicted through the Eviction API,
   which refuses (429) what a PodDisruptionBudget forbids: then the hold goes and the pod is tried again
   later; each victim and the preemptor are told why in an Event.

Evictions count toward the same cap as the verb's (``--max-evictions-per-minute`` per namespace of
preemptors). One pod is never preempted for twice: not while its hold stands, nor while kube-scheduler
asks the verb for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gpushared.contract import ContractError, ResourceNames
from gpushared.core.placement.nodefit import admits
from gpushared.core.placement.preemption import NodeVictims, pick_node
from gpushared.core.shared.bodies import PodBody, key_of, priority_of, scheduler_of, uid_of
from gpushared.core.shared.requests import PodRequest, pod_request
from gpushared.extender.cache import ClusterCache
from gpushared.extender.events import Event, no_event
from gpushared.extender.evicting import Evicted, evict_victims
from gpushared.extender.gatedwork import GatedPodWorker
from gpushared.extender.nominations import Offer
from gpushared.extender.preempting import ASKED_SECONDS, Preempter
from gpushared.kube.aioapi import AsyncApi

log = logging.getLogger(__name__)

#: How often the leader looks for pods to preempt for.
TICK_SECONDS = 1.0
#: How long a pod that fits nowhere waits for kube-scheduler's own preemption (the verb) before this one.
GRACE_SECONDS = 5.0
#: How long a pod for which no node has victims waits before it is looked at again.
RETRY_SECONDS = 10.0
#: The most nodes priced for one pod in one step (kube-scheduler's preemption tries at least 100).
MAX_NODES_TRIED = 100
#: The most time one step spends deciding: the event loop serves the verbs between steps.
STEP_SECONDS = 0.05


class Evictor(GatedPodWorker):
    tick_seconds = TICK_SECONDS

    def __init__(
        self,
        cache: ClusterCache,
        api: AsyncApi,
        preempter: Preempter,
        resources: ResourceNames,
        *,
        schedulers: frozenset[str],
        policy_v1: bool = True,
        clock: Callable[[], float] = time.monotonic,
        event: Event = no_event,
    ) -> None:
        """``schedulers``: those that call this extender (their pods are its to preempt for);
        ``policy_v1``: the Eviction API's version (policy/v1 from Kubernetes 1.22, policy/v1beta1 before)."""
        super().__init__(clock)
        self.cache, self.api, self.preempter, self.resources = cache, api, preempter, resources
        self.schedulers, self.policy_v1, self.event = schedulers, policy_v1, event
        #: pod UID -> when no node had victims for it (looked at again after RETRY_SECONDS)
        self.tried: dict[str, float] = {}
        #: evicted, refused (a PodDisruptionBudget), gone (deleted meanwhile), failed, capped
        self.counts: dict[str, int] = {"evicted": 0, "refused": 0, "gone": 0, "failed": 0, "capped": 0}
        #: where in the nodes the next search starts, and in the pending pods the next step
        self._cursor = 0
        self._pod_cursor = 0

    def step(self) -> int:
        """Preempt for the pods that wait for it; how many got victims evicted."""
        self.cache.owner.check("the evictor's step")
        self.cache.inbox.drain()
        self.preempter.nominations.prune()
        now, budget, started = self.clock(), time.perf_counter() + STEP_SECONDS, 0
        pending = list(self.cache.pending.items())
        start = self._pod_cursor % len(pending) if pending else 0
        looked = 0
        for key, pod in pending[start:] + pending[:start]:  # from where the last step stopped: none starves
            if time.perf_counter() > budget:
                break
            looked += 1
            request = self._preempting(pod, now)
            if request is None:
                continue
            chosen = self._choose(pod, request, budget)
            uid = uid_of(pod)
            if chosen is None or not chosen.victims.uids:  # no node frees a GPU, or its room is on its way
                self.tried[uid] = now
                continue
            namespace = key[0]
            if not self.preempter.cap.may_evict(namespace, now):
                self.counts["capped"] += 1
                self.tried[uid] = now
                continue
            self.preempter.cap.count(namespace, now, len(chosen.victims.uids))
            offer = Offer(
                chosen.victims.gpus, request.per_gpu, request.compute_request, priority_of(pod), now, evicted=True
            )
            self.preempter.nominations.offer(uid, chosen.node, offer)
            self.inflight.add(key)
            self.spawn(self._evict(key, pod, chosen))
            started += 1
        self._pod_cursor = start + looked
        waiting = self.cache.pending
        self.forget_gone(waiting.values(), [self.first_seen, self.tried], most=3 * len(waiting) + 100)
        return started

    def _preempting(self, pod: PodBody, now: float) -> PodRequest | None:
        """The pod's request where it is to be preempted for now, else None."""
        key, uid = key_of(pod), uid_of(pod)
        spec = pod.get("spec") or {}
        if key in self.inflight or spec.get("preemptionPolicy") == "Never":
            return None
        if spec.get("schedulingGates") or scheduler_of(pod) not in self.schedulers:
            return None
        if uid in self.preempter.nominations.offers or now - self.tried.get(uid, -RETRY_SECONDS) < RETRY_SECONDS:
            return None
        if now - self.preempter.asked.get(uid, -ASKED_SECONDS) < ASKED_SECONDS:
            return None  # kube-scheduler calls the verb for it: its preemption, not this one
        try:
            request = pod_request(pod, resources=self.resources)
        except ContractError:
            return None
        if request.total <= 0 or now - self.first_seen.setdefault(uid, now) < GRACE_SECONDS:
            return None  # a pod kube-scheduler places within the grace costs no search here
        passed, _ = self.cache.index.filter(list(self.cache.state.nodes), request)
        if any(self.preempter.nominations.fits(name, pod, request) for name in passed):
            return None  # it fits somewhere: kube-scheduler places it
        return request

    def _choose(self, pod: PodBody, request: PodRequest, budget: float) -> NodeVictims | None:
        """The node to preempt on and its victims: at most MAX_NODES_TRIED nodes the pod may use, from where
        the last search stopped, each with the verb's victims there; past the step's ``budget``, the best of
        the nodes tried so far (kube-scheduler too chooses among a sample of the nodes)."""
        priority, names = priority_of(pod), list(self.cache.state.nodes)
        if not names:
            return None
        options: list[NodeVictims] = []
        start = self._cursor % len(names)
        tried = 0
        for name in names[start:] + names[:start]:
            if tried >= MAX_NODES_TRIED or (tried and time.perf_counter() > budget):
                break
            state = self.cache.state.nodes[name]
            if state.ledger is None or (state.facts is not None and not admits(state.facts, pod)):
                continue
            tried += 1
            found = self.preempter.on_node(name, pod, request, priority)
            if found is not None and not found.victims.uids:
                return found  # pods terminating there free the room: evict no one more
            if found is not None:
                options.append(found)
        self._cursor = start + tried
        return pick_node(options)

    async def _evict(self, key: tuple[str, str], pod: PodBody, chosen: NodeVictims) -> None:
        """Evict the victims one by one; one a PodDisruptionBudget protects stops the rest, and the hold goes."""
        uid, node = uid_of(pod), chosen.node
        why = (
            f"on node {node} evicted by gpushared for pod {key[0]}/{key[1]} (priority {priority_of(pod)}), which "
            f"needs GPU {','.join(map(str, chosen.victims.gpus))} there"
        )
        try:
            bodies = self.cache.state.nodes[node].pods if node in self.cache.state.nodes else {}
            evicted = await evict_victims(
                self.api,
                chosen.victims.uids,
                bodies,
                preemptor=key,
                why=why,
                counts=self.counts,
                event=self.event,
                spawn=self.spawn,
                policy_v1=self.policy_v1,
            )
            if evicted is Evicted.REFUSED:  # nothing went, the room is not coming
                self.preempter.nominations.offers.pop(uid, None)
            if evicted is not Evicted.ALL:  # one that failed otherwise may have landed: the hold stays
                return
            self.spawn(
                self.event(pod, "Preempting", f"evicted {len(chosen.victims.uids)} pod(s) on node {node} for it")
            )
        finally:
            self.inflight.discard(key)
