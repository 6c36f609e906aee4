"""kube-scheduler 1.36 placing DRA claims by itself, modelled from its sources: the "before" that
gpushared's claim allocator (``replay.allocator``) is measured against.

On a DRA node no extender is called: kube-scheduler chooses the node with its default plugins and its
DRA allocator chooses the devices. What this module models, each rule with the source it is read from
(kubernetes/kubernetes at the 1.36 line):

- **Which nodes are looked at** (``pkg/scheduler/schedule_one.go``, ``numFeasibleNodesToFind`` and
  ``findNodesThatPassFilters``): with ``percentageOfNodesToScore`` unset, a cluster of 100 nodes or more
  stops filtering once it has found ``max(100, N * max(5, 50 - N/125) / 100)`` feasible nodes (497 of the
  trace's 1,213), searching from where the previous pod's search stopped (``nextStartNodeIndex`` moves on by
  the nodes processed, feasible or not). kube-scheduler checks nodes on 16 goroutines and may process a few
  more than it needs before it stops; this model checks them one after another.
- **Which of them wins** (the default plugins, ``pkg/scheduler/apis/config/v1/default_plugins.go``): the
  scores that differ between the trace's nodes are NodeResourcesFit's (``LeastAllocated`` over CPU and
  memory, weight 1 each, of the non-zero requests: 100 m and 200 MiB for a request of none;
  ``noderesources/least_allocated.go``, ``resource_allocation.go``) and NodeResourcesBalancedAllocation's
  (``1 - |cpu fraction - memory fraction| / 2`` of the actual requests, skipped for a pod that requests
  neither; ``noderesources/balanced_allocation.go``), each weight 1. TaintToleration, NodeAffinity,
  PodTopologySpread, InterPodAffinity and ImageLocality score every node alike here (no taints, preferences,
  spread constraints, affinities or images in the trace); DynamicResources scores only the alternatives of a
  prioritized list, which these claims do not have. The node with the highest total is the first that
  ``container/heap`` pops from the scored nodes in the order they were found (``newSortedNodeScores``):
  its ``Randomizer`` is set only where an extender scores, so without one equal totals are not drawn at
  random.
- **Which devices** (``staging/src/k8s.io/dynamic-resource-allocation/structured``, the allocator that
  supports consumable capacity): the node's pool is walked in slice order, device after device, and each
  request takes the first devices with room for it; no score weighs how full a device or a node is
  (KEP-4970, scoring for devices, is not in 1.36). gpushared's slice lists a node's GPUs by index; a request
  of several whole GPUs takes the first that are wholly free, a GPU never twice.

What is *not* modelled: preemption, and anything the trace does not carry (taints, affinities, images).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.mixbook import ExpectedMix
from gpushared.core.placement.policies import BINPACK, Policy
from gpushared.core.placement.pricing import PricingContext
from gpushared.core.shared.requests import PodRequest
from gpushared.core.shared.verdicts import judge
from gpushared.replay.cluster import SimCluster, SimNode
from gpushared.replay.trace import MAX_PODS, TraceNode, TracePod

#: What this placement is called in the replay's results, beside the extender's policies.
NAME = "kube-scheduler-dra"
#: The same nodes, with each node's devices chosen best fit (Aliyun's, binpack's GPU choice) instead of first
#: fit: not what kube-scheduler does, but what tells the loss of its node choice from its device choice.
BEST_FIT_NAME = "kube-scheduler-dra-best-fit"
#: ``schedule_one.go``: the fewest nodes a search stops at, and the smallest adaptive percentage.
MIN_FEASIBLE_NODES = 100
MIN_FEASIBLE_PERCENTAGE = 5
#: ``framework.MaxNodeScore``.
MAX_NODE_SCORE = 100
#: ``pkg/scheduler/util``: what a container requesting no CPU or memory counts as in LeastAllocated.
NON_ZERO_CPU_MILLI = 100
NON_ZERO_MEMORY_MIB = 200


def nodes_to_find(total: int, percentage: int = 0) -> int:
    """How many feasible nodes a search stops at in a cluster of ``total`` (``numFeasibleNodesToFind``);
    ``percentage`` 0 is the adaptive default."""
    if total < MIN_FEASIBLE_NODES:
        return total
    if percentage == 0:
        percentage = max(50 - total // 125, MIN_FEASIBLE_PERCENTAGE)
    return max(total * percentage // 100, MIN_FEASIBLE_NODES)


def least_allocated(requested: Sequence[int], allocatable: Sequence[int]) -> int:
    """NodeResourcesFit's LeastAllocated score, every resource weight 1: integer arithmetic as in Go."""
    scores = [
        0 if cap == 0 or req > cap else (cap - req) * MAX_NODE_SCORE // cap
        for req, cap in zip(requested, allocatable, strict=True)
    ]
    return sum(scores) // len(scores)


def balanced(requested: Sequence[int], allocatable: Sequence[int]) -> int:
    """NodeResourcesBalancedAllocation's score for two resources: ``(1 - |f1 - f2| / 2) * 100``, truncated."""
    fractions = [min(req / cap, 1.0) for req, cap in zip(requested, allocatable, strict=True) if cap]
    std = abs((fractions[0] - fractions[1]) / 2) if len(fractions) == 2 else 0.0
    return int((1 - std) * MAX_NODE_SCORE)


def heap_top(scores: Sequence[int]) -> int:
    """The index ``container/heap`` pops first from ``scores`` in this order, highest first, equal scores
    never swapped (every ``Randomizer`` 0): Go's ``heap.Init`` then the root."""
    order = list(range(len(scores)))

    def less(i: int, j: int) -> bool:
        return scores[order[i]] > scores[order[j]]

    n = len(order)
    for start in range(n // 2 - 1, -1, -1):
        i = start
        while (left := 2 * i + 1) < n:
            j = left + 1 if left + 1 < n and less(left + 1, left) else left
            if not less(j, i):
                break
            order[i], order[j] = order[j], order[i]
            i = j
    return order[0]


@dataclass
class Requests:
    """What kube-scheduler counts on a node beside its capacity: actual and non-zero requests."""

    cpu: int = 0
    memory: int = 0
    nonzero_cpu: int = 0
    nonzero_memory: int = 0

    def add(self, pod: TracePod) -> None:
        self.cpu += pod.cpu_milli
        self.memory += pod.memory_mib
        self.nonzero_cpu += pod.cpu_milli or NON_ZERO_CPU_MILLI
        self.nonzero_memory += pod.memory_mib or NON_ZERO_MEMORY_MIB


def node_score(node: SimNode, requests: Requests, pod: TracePod) -> int:
    """The total of the scores that differ between nodes, for ``pod`` on ``node``."""
    allocatable = (node.trace.cpu_milli, node.trace.memory_mib)
    nonzero = (
        requests.nonzero_cpu + (pod.cpu_milli or NON_ZERO_CPU_MILLI),
        requests.nonzero_memory + (pod.memory_mib or NON_ZERO_MEMORY_MIB),
    )
    score = least_allocated(nonzero, allocatable)
    if pod.cpu_milli or pod.memory_mib:  # BalancedAllocation skips a best-effort pod
        score += balanced((requests.cpu + pod.cpu_milli, requests.memory + pod.memory_mib), allocatable)
    return score


def first_fit(node: SimNode, request: PodRequest) -> tuple[int, ...] | None:
    """The devices the allocator takes on ``node``: in slice order (GPU index), the first ``request.gpus``
    GPUs with room for the request's share on each; None when fewer have room."""
    fitting = [verdict.gpu.index for verdict in judge(node.ledger, request) if verdict.fits]
    return tuple(fitting[: request.gpus]) if len(fitting) >= request.gpus else None


def best_fit(node: SimNode, request: PodRequest) -> tuple[int, ...] | None:
    """The GPUs binpack would give the request on ``node`` (the tightest with room); None when too few."""
    chosen = BINPACK.choose(judge(node.ledger, request), request, PricingContext(node.ledger))
    return None if chosen is None else tuple(verdict.gpu.index for verdict in chosen)


class FirstFitCluster(SimCluster):
    """The trace's cluster scheduled as kube-scheduler 1.36 schedules pods whose GPUs are DRA claims:
    nodes by the default scores over a rotating window, devices first fit. No gpushared policy is asked."""

    def __init__(
        self,
        nodes: Sequence[TraceNode],
        *,
        mix: RequestMix | None,
        rng: random.Random,
        links: bool = False,
        expected: ExpectedMix | None = None,
        compute: bool = False,
        devices: Callable[[SimNode, PodRequest], tuple[int, ...] | None] = first_fit,
        policy: Policy | None = None,
    ) -> None:
        """``devices``: how a node's devices are chosen (:func:`first_fit`, as kube-scheduler does).
        ``policy``: the claim allocator's, where a subclass places claims with one (``replay.allocator``)."""
        super().__init__(nodes, policy=policy, mix=mix, rng=rng, links=links, expected=expected, compute=compute)
        self.devices = devices
        self.requests = [Requests() for _ in self.nodes]
        #: per node, (CPU, memory) of a pod -> (node version scored at, the score)
        self.scores: list[dict[tuple[int, int], tuple[int, int]]] = [{} for _ in self.nodes]
        #: per node, (share, GPUs, compute) -> (node version found at, the devices first fit takes or None)
        self.fits: list[dict[tuple[int, int, int], tuple[int, tuple[int, ...] | None]]] = [{} for _ in self.nodes]
        self.next_start = 0
        self.window = nodes_to_find(len(self.nodes))

    def place(self, pod: TracePod) -> bool:
        request = self._request(pod)
        need = request.total
        found, processed = self._search(pod, request)
        total = len(self.nodes)
        self.next_start = (self.next_start + processed) % total
        if not found:
            if need:
                self.gpu_failed += 1
                self.gpu_failed_with_room += any(self._first_fit(i, request) is not None for i in range(total))
            return False
        if len(found) == 1:
            index, devices = found[0]
        else:
            scores = [self._score(i, pod) for i, _ in found]
            index, devices = found[heap_top(scores)]
        self.requests[index].add(pod)
        self._bind(self.nodes[index], pod, request, devices)
        return True

    def _search(self, pod: TracePod, request: PodRequest) -> tuple[list[tuple[int, tuple[int, ...]]], int]:
        """The feasible nodes of this cycle's window, with the devices first fit takes on each, and how many
        nodes were processed: kube-scheduler's filters (NodeResourcesFit, node affinity, the DRA allocator)
        from ``next_start`` until ``window`` are found. Written for speed: the hottest loop of the replay."""
        nodes, fits, total, window = self.nodes, self.fits, len(self.nodes), self.window
        cpu, memory, models, need = pod.cpu_milli, pod.memory_mib, pod.models, request.total
        slot = (need, request.gpus, request.compute_request)
        found: list[tuple[int, tuple[int, ...]]] = []
        processed = 0
        while processed < total and len(found) < window:
            index = (self.next_start + processed) % total
            processed += 1
            node = nodes[index]
            if cpu > node.cpu_free or memory > node.memory_free or node.pods >= MAX_PODS:
                continue
            if models and node.trace.model not in models:
                continue
            if not need:
                found.append((index, ()))
                continue
            if node.gpu_free < need:
                continue
            known = fits[index].get(slot)
            if known is not None and known[0] == node.version:
                devices = known[1]
            else:
                devices = self.devices(node, request)
                fits[index][slot] = (node.version, devices)
            if devices is not None:
                found.append((index, devices))
        return found, processed

    def _first_fit(self, index: int, request: PodRequest) -> tuple[int, ...] | None:
        """:func:`first_fit` on the node, kept until the node changes."""
        node = self.nodes[index]
        if node.gpu_free < request.total:
            return None
        slot = (request.total, request.gpus, request.compute_request)
        known = self.fits[index].get(slot)
        if known is not None and known[0] == node.version:
            return known[1]
        devices = self.devices(node, request)
        self.fits[index][slot] = (node.version, devices)
        return devices

    def _score(self, index: int, pod: TracePod) -> int:
        """:func:`node_score`, kept until the node changes."""
        node = self.nodes[index]
        slot = (pod.cpu_milli, pod.memory_mib)
        known = self.scores[index].get(slot)
        if known is not None and known[0] == node.version:
            return known[1]
        score = node_score(node, self.requests[index], pod)
        self.scores[index][slot] = (node.version, score)
        return score
