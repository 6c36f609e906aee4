"""A cluster of trace nodes scheduled as kube-scheduler with the gpushared extender would schedule it.

kube-scheduler's part is modelled: its filters (NodeResourcesFit on CPU, memory, pod count and the gpu-mem
extended resource; node affinity for the task's GPU models; NodeResourcesFit on gpu-count never decides
here, since the trace's multi-GPU tasks take whole GPUs, so a node's tasks never ask for more GPUs than it
has) and its default scores (NodeResourcesLeastAllocated + NodeResourcesBalancedAllocation). The extender's
part is not modelled but run, as deploy/'s scheduler configs wire it: every node's GPUs are a production
:class:`Ledger`, judged and priced as prioritize does (:meth:`Policy.appraise`: :func:`judge` less the
reasons) and chosen by the production :class:`Policy` in the node's :class:`PricingContext` (the CPU left,
for fgd); pods without GPU are priced by :func:`idle_gpu_mib` (the prioritize-no-gpu verb). The node the
scheduler takes is one that :func:`node_scores` would give the top score (:func:`ties` with
:func:`best_rank`): the extender's weight (100) dominates the in-tree scores, which then only break its ties
(the rest at random, as selectHost does).

A node's price for a request size is kept until the node changes, so one placement costs a re-judging of
one node, not of the cluster.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpushared.contract import ComputeShare, GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.placement.binding import holding_for
from gpushared.core.placement.claims.choice import Resources, kube_resource_score
from gpushared.core.placement.fragmentation import RequestMix, node_class, node_room
from gpushared.core.placement.mixbook import UNSEEN_WEIGHT, ExpectedMix, MixBook, kind_of
from gpushared.core.placement.policies import NodeRank, Policy, best_rank, ties
from gpushared.core.placement.pricing import NodeCpu, PricingContext
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.core.shared.topology import LinkKind, link_words, set_score
from gpushared.core.shared.verdicts import idle_gpu_mib
from gpushared.replay.layouts import model_layout
from gpushared.replay.trace import GPU_MIB, MAX_PODS, TraceNode, TracePod

#: How often, in allocation, the replay tells the mix what the nodes have left: every 5 % of the capacity,
#: about what an extender's 10 s recounts see of a busy cluster filling over minutes.
ROOMS_STEP = 0.05


@dataclass
class SimNode:
    """One node: its GPUs as a production ledger, and what kube-scheduler counts (kept as plain numbers,
    since every pod looks at every node)."""

    trace: TraceNode
    ledger: Ledger
    cpu_free: int = 0
    memory_free: int = 0
    gpu_free: int = 0  # the gpu-mem extended resource left, as NodeResourcesFit counts it
    pods: int = 0
    version: int = 0
    #: (need, GPUs, CPU, pinned to models, compute request) -> (version priced at, rank, GPUs chosen)
    prices: dict[tuple[int, int, int, bool, int], tuple[int, NodeRank | None, tuple[int, ...]]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self.cpu_free, self.memory_free = self.trace.cpu_milli, self.trace.memory_mib
        self.gpu_free = self.ledger.inventory.total

    @property
    def resources(self) -> Resources:
        cpu, memory = self.trace.cpu_milli, self.trace.memory_mib
        return Resources(cpu, cpu - self.cpu_free, memory, memory - self.memory_free)

    def admits(self, pod: TracePod) -> bool:
        """kube-scheduler's own filters: NodeResourcesFit (CPU, memory, pods) and node affinity."""
        if pod.cpu_milli > self.cpu_free or pod.memory_mib > self.memory_free or self.pods >= MAX_PODS:
            return False
        return not pod.models or self.trace.model in pod.models


def inventory_of(node: TraceNode, *, links: bool = False) -> GpuInventory:
    """The node's inventory; with ``links``, carrying the links its model is given (``model_layout``)."""
    topology = model_layout(node.model, node.gpus)
    return GpuInventory(
        unit=MemoryUnit.MIB,
        gpus=tuple(
            GpuInfo(
                index=i,
                uuid=f"{node.name}-gpu{i}",
                model=node.model,
                memory=GPU_MIB,
                memory_mib=GPU_MIB,
                numa=topology.numa.get(i) if links else None,
            )
            for i in range(node.gpus)
        ),
        links=link_words(topology, list(range(node.gpus))) if links and topology.known else (),
    )


@dataclass
class LinkTally:
    """How well linked the GPU sets of placed multi-GPU tasks are on the links each node's model is given,
    whether or not placement saw them: the sum of their scores, the sum of the best scores a set of that size
    has on an empty node of that model, and how many of the tasks on NVLink nodes got only NVLink pairs."""

    tasks: int = 0
    score: int = 0
    best: int = 0
    on_nvlink_nodes: int = 0
    all_nvlink: int = 0

    def add(self, node: TraceNode, gpus: Sequence[int]) -> None:
        topology = model_layout(node.model, node.gpus)
        self.tasks += 1
        self.score += set_score(gpus, topology)
        self.best += _best_score(node.model, node.gpus, len(gpus))
        if any(link.kind is LinkKind.NVLINK for link in topology.links.values()):
            self.on_nvlink_nodes += 1
            pairs = itertools.combinations(gpus, 2)
            self.all_nvlink += all(topology.link(a, b).kind is LinkKind.NVLINK for a, b in pairs)


@functools.cache
def _best_score(model: str, gpus: int, count: int) -> int:
    topology = model_layout(model, gpus)
    return max(set_score(chosen, topology) for chosen in itertools.combinations(range(gpus), count))


class SimCluster:
    def __init__(
        self,
        nodes: Sequence[TraceNode],
        *,
        policy: Policy | None,
        mix: RequestMix | None,
        rng: random.Random,
        links: bool = False,
        expected: ExpectedMix | None = None,
        compute: bool = False,
        window: int = 0,
        unseen: float = UNSEEN_WEIGHT,
    ) -> None:
        """``mix``: a request mix given from outside (the oracle: what the whole workload asks, known before
        the first task); None: the mix is counted as the extender counts it (``core.placement.mixbook``), from the
        tasks placed so far, a new one every ROOMS_STEP of the capacity, beside the operator's ``expected``
        mix where there is one (the extender's ``--expected-mix``). ``compute``: each GPU task also asks for
        its GPU share as a compute request (``TracePod.compute_request``), the ledger's second dimension.
        ``policy`` None: a subclass places without one (``replay.kubescheduler``); the mix is still counted.
        ``window``: how many of the nodes kube-scheduler's filters pass it sends the extender (0: all).
        ``unseen``: with no ``expected`` mix, the pods of each whole-node kind the counted mix weighs
        (``core.placement.mixbook.UNSEEN_WEIGHT``)."""
        self.nodes = [SimNode(trace=n, ledger=Ledger.build(inventory_of(n, links=links))) for n in nodes]
        #: the sets multi-GPU tasks got, scored on each node's model links (``links``: whether placement saw them)
        self.links = LinkTally()
        self.policy = policy
        self.rng = rng
        self.window = window
        self.next_start = 0
        self.compute = compute
        #: the cluster's nodes by class, as the extender counts them from the Nodes it watches
        self.classes = Counter(
            node_class(n.ledger.inventory, model=n.trace.model, cpu_allocatable=n.trace.cpu_milli) for n in self.nodes
        )
        #: the book the mix is taken from, as the extender keeps it (None: the mix was given)
        self.book: MixBook | None = None
        if mix is None:  # counted: the first mix, of no pods, before the first task (an extender's at a start)
            self.book = MixBook(expected, unseen=unseen)
            mix = self.book.take(nodes=self.classes)
        self.mix = mix
        #: whether the mix is taken again as tasks are placed: always when it is counted, and for a given
        #: mix only to tell it what the nodes have left (a policy that weighs scarcity)
        reads = policy is not None and (policy.reads_mix or policy.reads_pressure or policy.reads_rooms)
        self._recounts = policy is not None and (policy.reads_rooms or (self.book is not None and reads))
        self.capacity_mib = sum(n.ledger.inventory.total for n in self.nodes)
        self.allocated_mib = 0
        #: GPU tasks not placed, and of them those that GPUs had room for, on a node that kube-scheduler's own
        #: filters (CPU, memory, pod count, GPU model) refused: what GPU placement alone cannot win back
        self.gpu_failed = 0
        self.gpu_failed_with_room = 0
        self._serial = 0
        #: the allocation at which the mix is told the nodes' rooms again (every ROOMS_STEP of the capacity)
        self._rooms_due = ROOMS_STEP * self.capacity_mib

    def _count_mix(self) -> None:
        """What an extender does each time it counts the mix: take it from the pods counted (when counted),
        and tell it what every node has left now (for a policy that weighs scarcity). Every node's prices
        read the mix, so they are all worked out again."""
        self._rooms_due += ROOMS_STEP * self.capacity_mib
        rooms = None
        if self.policy is not None and self.policy.reads_rooms:
            rooms = Counter(
                node_room(
                    (node.ledger.free(gpu) for gpu in node.ledger.inventory.gpus),
                    model=node.trace.model,
                    cpu_free=node.cpu_free,
                )
                for node in self.nodes
            )
        if self.book is not None:
            self.mix = self.book.take(nodes=self.classes, rooms=rooms)
        elif rooms is not None:
            self.mix = self.mix.with_rooms(rooms)
        for node in self.nodes:
            node.prices.clear()

    def place(self, pod: TracePod) -> bool:
        """Schedule one pod; whether it was bound. A multi-GPU task asks gpu-count for its GPUs."""
        if self.allocated_mib >= self._rooms_due and self._recounts:
            self._count_mix()
        request = self._request(pod)
        need = request.total
        ranked: list[tuple[NodeRank, SimNode, tuple[int, ...]]] = []
        for node in self._candidates(pod, need):
            key, gpu = self._price(node, request, pod)
            if key is not None:
                ranked.append((key, node, gpu))
        best = best_rank(key for key, _, _ in ranked)
        if best is None:
            if need:
                self.gpu_failed += 1
                self.gpu_failed_with_room += any(
                    node.gpu_free >= need and self._price(node, request, pod)[0] is not None for node in self.nodes
                )
            return False
        node, indices = self._pick([(node, gpus) for key, node, gpus in ranked if ties(key, best)], pod)
        self._bind(node, pod, request, indices)
        return True

    def _request(self, pod: TracePod) -> PodRequest:
        """The task as a pod's request: its GPU memory on all its GPUs (gpu-count for a multi-GPU task), and
        with ``compute`` its share as a compute request."""
        need = pod.memory_request
        share = ComputeShare(request=pod.compute_request) if self.compute and need else None
        return PodRequest(
            containers=(ContainerRequest(name="main", amount=need, gpus=max(pod.num_gpu, 1)),), compute=share
        )

    def _bind(self, node: SimNode, pod: TracePod, request: PodRequest, indices: Sequence[int]) -> None:
        """Put ``pod`` on ``node``'s GPUs ``indices``: its CPU and memory counted, its GPUs held."""
        self._count(node, pod)
        holding = None
        need = request.total
        if need:
            self._serial += 1
            chosen = [node.ledger.inventory.gpus[index] for index in indices]
            if len(indices) > 1:
                self.links.add(node.trace, indices)
            holding = holding_for(request, chosen, uid=f"pod-{self._serial}", namespace="replay", name=pod.name)
            node.ledger.add(holding)
            node.gpu_free -= need
            self.allocated_mib += need
        if self.book is not None:  # as the extender's cache counts a pod its watch shows bound
            self.book.count(kind_of(pod.cpu_milli, holding, pod.models or None))

    def _candidates(self, pod: TracePod, need: int) -> list[SimNode]:
        """The nodes kube-scheduler sends the extender: every node its own filters pass (NodeResourcesFit with
        the gpu-mem resource, node affinity), or with a ``window``, the first that many of them from where
        the previous search stopped, as ``percentageOfNodesToScore`` has it (``replay.kubescheduler``)."""
        if not self.window:
            return [node for node in self.nodes if node.gpu_free >= need and node.admits(pod)]
        found: list[SimNode] = []
        processed, total = 0, len(self.nodes)
        while processed < total and len(found) < self.window:
            node = self.nodes[(self.next_start + processed) % total]
            processed += 1
            if node.gpu_free >= need and node.admits(pod):
                found.append(node)
        self.next_start = (self.next_start + processed) % total
        return found

    def _pick(self, cheapest: list[tuple[SimNode, tuple[int, ...]]], pod: TracePod) -> tuple[SimNode, tuple[int, ...]]:
        """Among the extender's cheapest: the best in-tree score, then at random."""
        if len(cheapest) > 1:
            scored = [(self._in_tree(node, pod), node, gpu) for node, gpu in cheapest]
            top = max(score for score, _, _ in scored)
            cheapest = [(node, gpu) for score, node, gpu in scored if score == top]
        return cheapest[self.rng.randrange(len(cheapest))]

    def _price(self, node: SimNode, request: PodRequest, pod: TracePod) -> tuple[NodeRank | None, tuple[int, ...]]:
        policy = self.policy
        if policy is None:
            raise TypeError("a cluster placed without a policy prices nothing")
        need = request.total
        pod_cpu = pod.cpu_milli if policy.reads_cpu else 0
        slot = (need, request.gpus, pod_cpu, bool(pod.models), request.compute_request)
        known = node.prices.get(slot)
        if known is not None and known[0] == node.version:
            return known[1], known[2]
        key: NodeRank | None
        indices: tuple[int, ...]
        if need == 0:  # a pod without GPU: the extender's prioritize-no-gpu
            key, indices = NodeRank(float(idle_gpu_mib(node.ledger))), ()
        else:  # prioritize
            cpu = NodeCpu(allocatable=node.trace.cpu_milli, requested=node.trace.cpu_milli - node.cpu_free)
            context = PricingContext(
                node.ledger,
                mix=self.mix,
                cpu=cpu,
                pod_cpu=pod.cpu_milli,
                model=node.trace.model,
                pinned=bool(pod.models),  # gpu_spec: the node affinity an extender reads (gpu_models)
                pod_compute=request.compute_request,
            )
            appraised = policy.appraise(node.ledger, request, context)
            key, indices = (None, ()) if appraised is None else (appraised[0], tuple(v.gpu.index for v in appraised[1]))
        node.prices[slot] = (node.version, key, indices)
        return key, indices

    def _in_tree(self, node: SimNode, pod: TracePod) -> int:
        """kube-scheduler 1.20's default resource scores after placing ``pod``: NodeResourcesLeastAllocated
        plus NodeResourcesBalancedAllocation, weight 1 each."""
        return int(kube_resource_score(node.resources, pod_cpu=pod.cpu_milli, pod_memory=pod.memory_mib))

    def _count(self, node: SimNode, pod: TracePod) -> None:
        node.cpu_free -= pod.cpu_milli
        node.memory_free -= pod.memory_mib
        node.pods += 1
        node.version += 1

    # --- measures ------------------------------------------------------------------------------------------

    @property
    def allocation(self) -> float:
        """Allocated GPU memory, % of the cluster's."""
        return 100 * self.allocated_mib / self.capacity_mib

    def leftovers(self, tasks: Sequence[TracePod]) -> tuple[float, float]:
        """GPUs unallocated, and those on nodes where none of ``tasks`` fits by CPU and memory any more."""
        smallest_cpu = min((t.cpu_milli for t in tasks), default=0)
        smallest_memory = min((t.memory_mib for t in tasks), default=0)
        unallocated = stranded = 0
        for node in self.nodes:
            unallocated += node.gpu_free
            if node.cpu_free < smallest_cpu or node.memory_free < smallest_memory or node.pods >= MAX_PODS:
                stranded += node.gpu_free
        return unallocated / GPU_MIB, stranded / GPU_MIB

    def fragmentation_rate(self, typical: Sequence[tuple[TracePod, float]]) -> float:
        """The paper's fragmentation rate: GPU memory that the typical pods (each with its share of the
        workload) cannot use, % of the unallocated. A node's free GPU is all fragment for a pod the node
        cannot host (short of CPU, or of GPUs with room); for one it can host, the GPUs with less free than
        the pod needs are. CPU-only pods count all free GPU as fragment, as in the paper."""
        fragment = 0.0
        for node in self.nodes:
            free = [node.ledger.free(gpu) for gpu in node.ledger.inventory.gpus]
            total = sum(free)
            if total == 0:
                continue
            for pod, share in typical:
                per_gpu = round(pod.gpu_milli * GPU_MIB / 1000)
                hosts = (
                    pod.num_gpu > 0
                    and pod.cpu_milli <= node.cpu_free
                    and (not pod.models or node.trace.model in pod.models)
                    and sum(1 for f in free if f >= per_gpu) >= pod.num_gpu
                )
                fragment += share * (sum(f for f in free if f < per_gpu) if hosts else total)
        unallocated = self.capacity_mib - self.allocated_mib
        return 100 * fragment / unallocated if unallocated else 0.0
