"""Preemption that frees a GPU: the extender's ``preempt`` verb, and the room it freed held for its preemptor.

kube-scheduler counts ``aliyun.com/gpu-mem`` as one number per node, so its own choice of victims frees
memory on the node but not room on one GPU: a 10 GiB pod on a node whose GPUs each have 6 GiB free gets a
6 GiB pod evicted and still fits nowhere. kube-scheduler asks every extender with a ``preemptVerb`` to
revise its choice: for each node it proposes, the extender answers the pods to evict there instead
(``core.placement.preemption.select_victims``: on one GPU, or on as many as the pod asks, the lowest
priorities first, then the fewest PodDisruptionBudgets broken, then the fewest pods), or leaves the node
out where no set of lower-priority pods frees a GPU. kube-scheduler then picks one of the nodes, evicts
those victims and nominates the node on the pod (``status.nominatedNodeName``).

Until the preemptor binds, the GPUs its victims free are held for it (``nominations``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable

from gpushared.contract import ContractError, ResourceNames
from gpushared.core.placement.cpu import cpu_of, memory_request
from gpushared.core.placement.nodes import NodeState
from gpushared.core.placement.preemption import NodeVictims, Occupant, Victims, select_victims
from gpushared.core.shared.bodies import PodBody, key_of, meta_of, priority_of, uid_of
from gpushared.core.shared.requests import PodRequest, pod_request
from gpushared.extender.cache import ClusterCache
from gpushared.extender.evictioncap import MAX_EVICTIONS_PER_MINUTE, EvictionCap
from gpushared.extender.http.wire import PreemptionArgs
from gpushared.extender.nominations import Nominations, Offer

log = logging.getLogger(__name__)

#: The most nodes of one preempt call looked at, and how long the verb decides before the loop serves others.
MAX_NODES_ANSWERED = 100
TURN_SECONDS = 0.02
#: How long a pod kube-scheduler asked the verb for is left to it, and the most such pods remembered.
ASKED_SECONDS = 60.0
MAX_ASKED = 10_000


class Preempter:
    """The ``preempt`` verb: kube-scheduler's proposed nodes, each with the victims that free a GPU.

    At most ``max_evictions_per_minute`` pods are evicted a minute for the preemptors of one namespace (its
    preemptions past that get no node, and wait): one tenant's high-priority pods cannot churn the others'
    without end. 0 turns preemption of GPU pods off."""

    def __init__(
        self,
        cache: ClusterCache,
        resources: ResourceNames,
        *,
        clock: Callable[[], float],
        nominations: Nominations,
        max_evictions_per_minute: int = MAX_EVICTIONS_PER_MINUTE,
    ) -> None:
        self.cache, self.resources, self.clock = cache, resources, clock
        self.nominations = nominations
        #: the evictions of every path, per namespace of preemptors (``evictioncap``)
        self.cap = EvictionCap(max_evictions_per_minute)
        #: per node proposed: kept (victims that free a GPU), dropped (none does), passed (not a GPU pod),
        #: capped (the preemptor's namespace evicted its most this minute)
        self.counts: dict[str, int] = {"kept": 0, "dropped": 0, "passed": 0, "capped": 0}
        #: pod UID -> when kube-scheduler last asked the verb for it: the extender's own preemption
        #: (``evictions``) leaves such a pod to kube-scheduler
        self.asked: dict[str, float] = {}

    async def preempt(self, args: PreemptionArgs) -> dict[str, tuple[tuple[str, ...], int]]:
        """For each node kube-scheduler proposes, the pods to evict there (by UID) and the PDB violations;
        the nodes where no eviction frees a GPU for the pod are left out. At most MAX_NODES_ANSWERED nodes are
        looked at (kube-scheduler's own dry run looks at 10 % of the nodes, at least 100), and the event loop
        serves the other verbs every TURN_SECONDS meanwhile: one node's search is a few ms, a full 16-GPU
        node's up to 0.1 s."""
        self.cache.owner.check("preempt")
        pod = args.pod
        if (pod.get("spec") or {}).get("preemptionPolicy") == "Never":
            return {}
        try:
            request = pod_request(pod, resources=self.resources)
        except ContractError as exc:
            log.info("preempt: pod %s: %s", uid_of(pod), exc)
            return {}
        if request.total <= 0:  # not a GPU pod: kube-scheduler's own victims stand
            self.counts["passed"] += len(args.victims)
            return {node: (uids, args.pdb_violations.get(node, 0)) for node, uids in args.victims.items()}
        self.nominations.prune()
        namespace, now = key_of(pod)[0], self.clock()
        self.asked[uid_of(pod)] = now
        if len(self.asked) > MAX_ASKED:
            self.asked = {u: t for u, t in self.asked.items() if now - t < ASKED_SECONDS}
        if not self.cap.may_evict(namespace, now):
            self.counts["capped"] += len(args.victims)
            log.info("preempt: namespace %s evicted its most this minute; pod %s waits", namespace, uid_of(pod))
            return {}
        priority, uid = priority_of(pod), uid_of(pod)
        answer: dict[str, tuple[tuple[str, ...], int]] = {}
        turn = time.perf_counter() + TURN_SECONDS
        for node, theirs in itertools.islice(args.victims.items(), MAX_NODES_ANSWERED):
            if time.perf_counter() > turn:
                await asyncio.sleep(0)
                turn = time.perf_counter() + TURN_SECONDS
            chosen = self.on_node(node, pod, request, priority, theirs)
            if chosen is None:
                self.counts["dropped"] += 1
                continue
            self.counts["kept"] += 1
            victims, gpus = chosen.victims, chosen.victims.gpus
            answer[node] = (victims.uids, victims.pdb_violations)
            offer = Offer(gpus, request.per_gpu, request.compute_request, priority, now)
            self.nominations.offer(uid, node, offer)
        log.info(
            "preempt: pod %s/%s (priority %d), %d node(s) proposed: %s",
            namespace,
            key_of(pod)[1],
            priority,
            len(args.victims),
            "; ".join(f"{n}: evict {', '.join(v) or 'nothing'}" for n, (v, _) in answer.items())
            or "no node frees a GPU",
        )
        if answer:  # kube-scheduler evicts on one of the nodes: counted as the fewest
            self.cap.count(namespace, now, min(len(v) for v, _ in answer.values()))
        return answer

    def on_node(
        self, node: str, pod: PodBody, request: PodRequest, priority: int, theirs: Iterable[str] = ()
    ) -> NodeVictims | None:
        """The victims that free a GPU for the pod on ``node`` (and, from ``theirs``, kube-scheduler's, the CPU
        and memory it needs there), or None where no eviction does. Where pods of lower priority already
        terminating there free enough (a preemption whose evictions landed, this process's or a previous
        leader's), none: the room is on its way, and evicting others would free it no sooner (kube-scheduler
        too preempts no more while its nominated node has such pods)."""
        usable = self.cache.state.usable(node, gpus=request.gpus)
        if not isinstance(usable, tuple):
            return None
        state, ledger = usable
        budgets = self.cache.budgets
        occupants = {
            h.uid: Occupant(priority=h.priority, pdbs=budgets.of(state.pods[h.uid]))
            for h in ledger.holdings()
            if not h.kept and h.uid in state.pods
        }
        allowed = budgets.allowed()
        going = {
            uid: occupant for uid, occupant in occupants.items() if meta_of(state.pods[uid]).get("deletionTimestamp")
        }
        if going:
            coming = select_victims(ledger, request, priority=priority, occupants=going)
            if coming is not None and _other_resources_fit(state, pod, list(coming.uids)):
                return NodeVictims(node, Victims((), coming.gpus, None, 0), ())
            occupants = {uid: occupant for uid, occupant in occupants.items() if uid not in going}
        found: Victims | None = select_victims(
            ledger, request, priority=priority, occupants=occupants, pdb_allowed=allowed
        )
        if found is None:
            return None
        victims = list(found.uids)
        # kube-scheduler's victims free what else the pod needs there (CPU, memory); ours may free less of it
        extra = [u for u in theirs if u not in victims and priority_of(state.pods.get(u) or {}) < priority]
        while not _other_resources_fit(state, pod, victims):
            if not extra:
                return None
            victims.append(extra.pop(0))
        priorities = tuple(priority_of(state.pods[u]) for u in victims if u in state.pods)
        highest = max(priorities, default=None)
        chosen = Victims(tuple(victims), found.gpus, highest, found.pdb_violations)
        return NodeVictims(node, chosen, priorities)


def _other_resources_fit(state: NodeState, pod: PodBody, victims: list[str]) -> bool:
    """Whether the pod's CPU and memory requests fit the node once the victims are gone, as the cache counts
    the node's pods (a node that does not say what it has is kube-scheduler's to judge)."""
    gone = [state.pods[u] for u in victims if u in state.pods]
    if state.cpu_allocatable is not None:
        freed = sum(cpu_of(p) for p in gone)
        if state.cpu_requested - freed + cpu_of(pod) > state.cpu_allocatable:
            return False
    if state.memory_allocatable is not None:
        freed = sum(memory_request(p) for p in gone)
        if state.memory_requested - freed + memory_request(pod) > state.memory_allocatable:
            return False
    return True
