"""The trace replay with pod priorities, and preemption as kube-scheduler does it with gpushared's preempt verb.

Each task gets a priority from its ``qos`` column (:data:`PRIORITY_OF_QOS`): latency-sensitive (LS) pods high,
Guaranteed and Burstable in the middle, best-effort (BE) low. Placement is the replay's (:class:`SimCluster`,
the extender's policy); what happens to a GPU task that fits nowhere depends on the mode (:data:`MODES`):

- ``off``: it fails, as in every other replay (the placements are those of ``run.replay``, seed for seed);
- ``evict``: kube-scheduler's PostFilter preemption, with the extender's preempt verb choosing the victims on
  each node; the evicted pods are lost (counted, their GPU memory, CPU and memory freed);
- ``requeue``: the same, and each evicted pod is scheduled once more right after its preemptor is bound, as its
  controller's new pod would be (it may preempt lower pods in turn; one that finds no room then is lost).
  A retried pod is no new arrival: it never counts towards the arrived workload.

Preemption, per node, as the two do it together: the victims that give the pod room on ``request.gpus`` GPUs are
:func:`select_victims`'s (strictly lower priority, fewest and least important first); when the node's CPU,
memory or pod count still refuse the pod once they go, kube-scheduler's own victims are added for that, the
other lower-priority pods of the node, lowest priority first, then the largest CPU first, until it fits (the
extender adds kube-scheduler's in its order; this is the order its reprieve would leave). No PodDisruptionBudget
is modelled: every candidate has 0 violations. A node is a candidate only for a pod its node affinity allows.

Which node: kube-scheduler's ``pickOneNodeForPreemption``: the lowest highest victim priority, then the fewest
PDB violations (0 here), then the lowest sum of victim priorities, then the fewest victims, then the first in
the replay's node order (kube-scheduler's start-time criterion is left out: every victim here is running).
The preemptor then takes the GPUs the policy chooses among those free on that node once the victims are gone.

The search is bounded as kube-scheduler bounds its dry run: from a random node (the replay's seed), nodes are
tried in order until :func:`candidates_wanted` of them have victims (10 % of the nodes, at least 100). A node
whose lower-priority pods, all gone, would still leave too little GPU memory on too few GPUs, or too little
CPU or memory, is passed over without a search (it could give no victims), which is what keeps a replay fast.

Everything is causal: only the pods that already arrived are placed, evicted or retried.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from gpushared.core.placement.mixbook import UNSEEN_WEIGHT, ExpectedMix, kind_of
from gpushared.core.placement.policies import Policy, policy_named
from gpushared.core.placement.preemption import NodeVictims, Occupant, Victims, pick_node, select_victims
from gpushared.core.shared.requests import PodRequest
from gpushared.replay.cluster import SimCluster, SimNode
from gpushared.replay.run import RATIO, tuned
from gpushared.replay.trace import MAX_PODS, TraceNode, TracePod

HIGH: Final = 1000
MIDDLE: Final = 500
LOW: Final = 0
#: A task's priority by its ``qos`` column; a task without one is low.
PRIORITY_OF_QOS: Final[Mapping[str, int]] = {"LS": HIGH, "Guaranteed": MIDDLE, "Burstable": MIDDLE, "BE": LOW}
#: The priority classes reported, by name.
CLASSES: Final[Mapping[str, int]] = {"high": HIGH, "middle": MIDDLE, "low": LOW}
MODES: Final = ("off", "evict", "requeue")
#: kube-scheduler's DefaultPreemption: minCandidateNodesPercentage and minCandidateNodesAbsolute.
MIN_CANDIDATES_PERCENT: Final = 10
MIN_CANDIDATES_ABSOLUTE: Final = 100


def read_priorities(path: Path) -> dict[str, int]:
    """Each task's priority by name, from a pod list's ``qos`` column (``TracePod`` does not carry it). A list
    without the column (the trace's multigpu ones) is refused: every task would be low, and nothing preempt."""
    with path.open(newline="") as stream:
        reader = csv.DictReader(stream)
        if "qos" not in (reader.fieldnames or ()):
            raise ValueError(f"{path.name} has no qos column: its tasks have no priority")
        return {row["name"]: PRIORITY_OF_QOS.get(row["qos"], LOW) for row in reader}


def candidates_wanted(nodes: int) -> int:
    """How many nodes with victims kube-scheduler's dry run looks for before it stops."""
    return min(nodes, max(nodes * MIN_CANDIDATES_PERCENT // 100, MIN_CANDIDATES_ABSOLUTE))


@dataclass
class Placed:
    """A pod bound on a node: what evicting it frees."""

    pod: TracePod
    priority: int
    #: its holding in the node's ledger (None: a pod without GPU)
    uid: str | None
    request: PodRequest


@dataclass
class Tally:
    """What preemption did: GPU demand placed now by priority, and what was evicted and retried."""

    placed_milli: dict[int, int] = field(default_factory=dict)
    evicted_pods: dict[int, int] = field(default_factory=dict)
    evicted_milli: dict[int, int] = field(default_factory=dict)
    preemptions: int = 0
    retried: int = 0
    retried_placed: int = 0
    #: nodes searched with ``select_victims``
    searches: int = 0

    def bump(self, counts: dict[int, int], priority: int, amount: int) -> None:
        counts[priority] = counts.get(priority, 0) + amount


class PriorityCluster(SimCluster):
    """A :class:`SimCluster` whose pods have priorities and, with ``preempt``, preempt lower ones."""

    def __init__(
        self,
        nodes: Sequence[TraceNode],
        *,
        priority_of: Callable[[TracePod], int],
        preempt: bool,
        requeue: bool = False,
        **kwargs: object,
    ) -> None:
        super().__init__(nodes, **kwargs)  # type: ignore[arg-type]
        self.priority_of, self.preempt, self.requeue = priority_of, preempt, requeue
        self.tally = Tally()
        #: each node's pods, by uid, in the replay's node order
        self.on_node: list[dict[str, Placed]] = [{} for _ in self.nodes]
        #: each node's CPU, memory, pods and GPU memory per GPU held by pods of each priority: the bound
        self.held: list[dict[int, list[int]]] = [{} for _ in self.nodes]
        self._where = {id(node): i for i, node in enumerate(self.nodes)}
        self._cpu_only = 0
        self._binding = LOW
        self.wanted = candidates_wanted(len(self.nodes))
        self._index_of = {node.trace.name: index for index, node in enumerate(self.nodes)}

    def place(self, pod: TracePod) -> bool:
        priority = self.priority_of(pod)
        self._binding = priority
        if super().place(pod):
            return True
        if not self.preempt or not pod.memory_request or priority <= LOW:
            return False
        return self._preempt(pod, priority)

    def _bind(self, node: SimNode, pod: TracePod, request: PodRequest, indices: Sequence[int]) -> None:
        super()._bind(node, pod, request, indices)
        priority, index = self._binding, self._where[id(node)]
        uid: str | None = None
        if request.total:
            uid = f"pod-{self._serial}"
            holding = node.ledger.holding(uid)
            assert holding is not None
            node.ledger.add(replace(holding, priority=priority))  # as the extender's cache has it
        else:
            self._cpu_only += 1
        placed = Placed(pod, priority, uid, request)
        self.on_node[index][uid or f"cpu-{self._cpu_only}"] = placed
        self._hold(index, placed, indices, sign=+1)
        self.tally.bump(self.tally.placed_milli, priority, pod.gpu_demand)

    def _hold(self, index: int, placed: Placed, gpus: Sequence[int], *, sign: int) -> None:
        """Counts a pod in (or out of) its node's sums for its priority: [CPU, memory, pods, GPU 0, ...]."""
        size = 3 + len(self.nodes[index].ledger.inventory.gpus)
        sums = self.held[index].setdefault(placed.priority, [0] * size)
        sums[0] += sign * placed.pod.cpu_milli
        sums[1] += sign * placed.pod.memory_mib
        sums[2] += sign
        for gpu in gpus:
            sums[3 + gpu] += sign * placed.request.per_gpu

    # --- preemption ------------------------------------------------------------------------------------------

    def _preempt(self, pod: TracePod, priority: int) -> bool:
        """kube-scheduler's PostFilter: victims on the candidate nodes, the best node, evictions, the bind."""
        request = self._request(pod)
        start = self.rng.randrange(len(self.nodes))
        found: list[NodeVictims] = []
        for step in range(len(self.nodes)):
            index = (start + step) % len(self.nodes)
            if self._may_host(index, pod, priority, request):
                candidate = self._victims_on(index, pod, priority, request)
                if candidate is not None:
                    found.append(candidate)
                    if len(found) >= self.wanted:
                        break
        if not found:
            return False
        best = pick_node(found)  # node names order as the nodes do: the first node breaks the last tie
        assert best is not None
        index = self._index_of[best.node]
        node = self.nodes[index]
        evicted = [self._evict(index, uid) for uid in best.victims.uids]
        key, indices = self._price(node, request, pod)
        self._binding = priority
        self._bind(node, pod, request, best.victims.gpus if key is None else indices)
        self.tally.preemptions += 1
        if self.requeue:
            for placed in evicted:
                self.tally.retried += 1
                self.tally.retried_placed += self.place(placed.pod)
        return True

    def _may_host(self, index: int, pod: TracePod, priority: int, request: PodRequest) -> bool:
        """Whether the pod could fit on the node were every pod of lower priority gone: short of that, no
        victims (the bound that spares most searches)."""
        node = self.nodes[index]
        if pod.models and node.trace.model not in pod.models:
            return False
        lower = [sums for p, sums in self.held[index].items() if p < priority]
        if not lower:
            return False
        freed = [sum(column) for column in zip(*lower, strict=True)]
        if pod.cpu_milli > node.cpu_free + freed[0] or pod.memory_mib > node.memory_free + freed[1]:
            return False
        if node.pods - freed[2] >= MAX_PODS:
            return False
        ledger = node.ledger
        roomy = sum(1 for gpu in ledger.inventory.gpus if ledger.free(gpu) + freed[3 + gpu.index] >= request.per_gpu)
        return roomy >= request.gpus

    def _victims_on(self, index: int, pod: TracePod, priority: int, request: PodRequest) -> NodeVictims | None:
        """The extender's victims on the node (``select_victims``), and kube-scheduler's for CPU and memory."""
        node, pods = self.nodes[index], self.on_node[index]
        occupants = {p.uid: Occupant(priority=p.priority) for p in pods.values() if p.uid is not None}
        self.tally.searches += 1
        chosen = select_victims(node.ledger, request, priority=priority, occupants=occupants)
        if chosen is None:
            return None
        victims = list(chosen.uids)  # a GPU pod is kept under its holding's uid
        extra = sorted(
            (u for u, p in pods.items() if p.priority < priority and u not in victims),
            key=lambda u: (pods[u].priority, -pods[u].pod.cpu_milli, u),
        )
        while not self._admits_without(node, pod, [pods[u] for u in victims]):
            if not extra:
                return None
            victims.append(extra.pop(0))
        if not victims:
            return None  # it fits with nothing evicted: the policy refused the node, no eviction changes that
        priorities = tuple(pods[u].priority for u in victims)
        return NodeVictims(node.trace.name, Victims(tuple(victims), chosen.gpus, max(priorities), 0), priorities)

    @staticmethod
    def _admits_without(node: SimNode, pod: TracePod, gone: Sequence[Placed]) -> bool:
        cpu = node.cpu_free + sum(p.pod.cpu_milli for p in gone)
        memory = node.memory_free + sum(p.pod.memory_mib for p in gone)
        return pod.cpu_milli <= cpu and pod.memory_mib <= memory and node.pods - len(gone) < MAX_PODS

    def _evict(self, index: int, uid: str) -> Placed:
        """Removes the pod from its node: its GPU memory, CPU and memory freed, its kind uncounted."""
        node = self.nodes[index]
        placed = self.on_node[index].pop(uid)
        holding = node.ledger.remove(placed.uid) if placed.uid is not None else None
        gpus = sorted(holding.gpus) if holding is not None else []
        node.cpu_free += placed.pod.cpu_milli
        node.memory_free += placed.pod.memory_mib
        node.pods -= 1
        node.version += 1
        need = placed.request.total
        node.gpu_free += need
        self.allocated_mib -= need
        if self.book is not None:  # the extender's cache uncounts a pod that is gone
            self.book.uncount(kind_of(placed.pod.cpu_milli, holding, placed.pod.models or None))
        self._hold(index, placed, gpus, sign=-1)
        tally = self.tally
        tally.bump(tally.placed_milli, placed.priority, -placed.pod.gpu_demand)
        tally.bump(tally.evicted_pods, placed.priority, 1)
        tally.bump(tally.evicted_milli, placed.priority, placed.pod.gpu_demand)
        return placed


@dataclass(frozen=True)
class PriorityReplay:
    policy: str
    seed: int
    mode: str
    #: at 0, 1, ... RATIO*100 % arrived: the allocation (% of the cluster's GPU memory), and of each class
    #: (``CLASSES``) the GPU demand placed and still held, % of that class's GPU demand arrived
    allocation: list[float]
    classes: dict[str, list[float]]
    #: at the same points, pods evicted so far and their GPU demand (milli), all classes
    evicted_pods: list[int]
    evicted_milli: list[int]
    #: at the end, by class name
    evicted_by_class: dict[str, int]
    arrived_by_class: dict[str, int]
    preemptions: int
    retried: int
    retried_placed: int
    searches: int
    placed: int
    failed: int


def priority_replay(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    *,
    priorities: Mapping[str, int],
    policy: str | Policy,
    seed: int,
    mode: str,
    expected: ExpectedMix | None = None,
    unseen: float = UNSEEN_WEIGHT,
) -> PriorityReplay:
    """One replay as ``run.replay`` runs it (the workload tuned to ``RATIO`` with the seed, the mix counted
    from the pods placed beside ``expected``), each pod of priority ``priorities[name]`` (low when absent), in
    ``mode`` (:data:`MODES`)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    rng = random.Random(seed)
    capacity_milli = 1000 * sum(n.gpus for n in nodes)
    workload = tuned(pods, capacity_milli=capacity_milli, ratio=RATIO, rng=rng)
    chosen = policy if isinstance(policy, Policy) else policy_named(policy)
    cluster = PriorityCluster(
        nodes,
        priority_of=lambda pod: priorities.get(pod.name, LOW),
        preempt=mode != "off",
        requeue=mode == "requeue",
        policy=chosen,
        mix=None,
        rng=rng,
        expected=expected,
        unseen=unseen,
    )
    tally = cluster.tally
    allocation: list[float] = []
    classes: dict[str, list[float]] = {name: [] for name in CLASSES}
    evicted_pods: list[int] = []
    evicted_milli: list[int] = []
    arrived_by: dict[int, int] = {}
    arrived = placed = failed = 0
    last = round(RATIO * 100)

    def record() -> None:
        allocation.append(cluster.allocation)
        for name, level in CLASSES.items():
            demand = arrived_by.get(level, 0)
            classes[name].append(100 * tally.placed_milli.get(level, 0) / demand if demand else 100.0)
        evicted_pods.append(sum(tally.evicted_pods.values()))
        evicted_milli.append(sum(tally.evicted_milli.values()))

    for pod in workload:
        priority = priorities.get(pod.name, LOW)
        arrived_by[priority] = arrived_by.get(priority, 0) + pod.gpu_demand
        if cluster.place(pod):
            placed += 1
        else:
            failed += 1
        arrived += pod.gpu_demand
        while len(allocation) <= last and len(allocation) <= 100 * arrived / capacity_milli:
            record()
    while len(allocation) <= last:  # the points past the whole workload: where it ended
        record()
    return PriorityReplay(
        policy=chosen.name,
        seed=seed,
        mode=mode,
        allocation=allocation,
        classes=classes,
        evicted_pods=evicted_pods,
        evicted_milli=evicted_milli,
        evicted_by_class={name: tally.evicted_pods.get(level, 0) for name, level in CLASSES.items()},
        arrived_by_class={name: arrived_by.get(level, 0) for name, level in CLASSES.items()},
        preemptions=tally.preemptions,
        retried=tally.retried,
        retried_placed=tally.retried_placed,
        searches=tally.searches,
        placed=placed,
        failed=failed,
    )
