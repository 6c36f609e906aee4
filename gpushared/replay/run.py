"""One replay as the FGD paper runs it (Weng et al., ATC'23, and its simulator): arrivals only, no
departures; the trace's tasks plus tasks drawn from it at random until their GPU demand is ``ratio`` times the
cluster's GPUs; shuffled with the seed; scheduled one by one; the allocation recorded at every 1 % of
arrived workload (GPU demand of the tasks seen so far, % of the cluster's GPUs)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gpushared.core.placement.fragmentation import ModelKind, RequestMix, node_class
from gpushared.core.placement.mixbook import UNSEEN_WEIGHT, ExpectedMix, request_kind
from gpushared.core.placement.policies import Policy, policy_named
from gpushared.replay import allocator, kubescheduler
from gpushared.replay.cluster import LinkTally, SimCluster, inventory_of
from gpushared.replay.trace import TraceNode, TracePod

#: The paper's workload inflation ("tune") and seeds.
RATIO = 1.3
SEEDS = tuple(range(42, 52))
#: Where the fragmentation rate is reported (% of arrived workload).
FRAG_AT = 90


@dataclass(frozen=True)
class Replay:
    policy: str
    seed: int
    #: allocation (% of cluster GPU memory) at 0, 1, ... RATIO*100 % arrived
    allocation: list[float]
    frag_rate: float
    #: multi-GPU tasks that arrived, the GPUs they asked for, and how many of the tasks were placed
    multi_gpu_tasks: int
    multi_gpu_gpus: int
    multi_gpu_placed: int
    placed: int
    failed: int
    #: at the end: GPUs unallocated, and those of them on nodes that no one-GPU task of the workload fits by
    #: CPU or memory any more (stranded by CPU, not by GPU memory)
    unallocated_gpus: float = 0.0
    stranded_gpus: float = 0.0
    #: GPU tasks not placed, and of them those with GPUs that had room on a node short of CPU or memory
    gpu_failed: int = 0
    gpu_failed_with_room: int = 0
    #: whether placement saw the nodes' model links, and how well linked the multi-GPU tasks' sets were
    links_seen: bool = False
    links: LinkTally | None = None


def tuned(pods: Sequence[TracePod], *, capacity_milli: int, ratio: float, rng: random.Random) -> list[TracePod]:
    """The trace's tasks, then random draws from it until the next would pass ``ratio`` of capacity; shuffled."""
    workload = list(pods)
    demand = sum(p.gpu_demand for p in workload)
    target = ratio * capacity_milli
    while True:
        draw = pods[rng.randrange(len(pods))]
        if demand + draw.gpu_demand > target:
            break
        workload.append(draw)
        demand += draw.gpu_demand
    rng.shuffle(workload)
    return workload


def replay(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    *,
    policy: str | Policy,
    seed: int,
    links: bool = False,
    causal: bool = True,
    expected: ExpectedMix | None = None,
    compute: bool = False,
    window: bool = False,
    unseen: float = UNSEEN_WEIGHT,
) -> Replay:
    """``links``: the nodes carry the links of their model (``replay.layouts.model_layout``) and placement
    weighs them; without, placement sees none. Either way the sets chosen are scored on them.

    ``causal`` (the default): the request mix is counted as a running extender counts it, from the tasks
    placed so far (``core.placement.mixbook``), beside the operator's ``expected`` mix where one is given
    (the extender's ``--expected-mix``; for a figure, made by :func:`trace_kinds` from *another* trace).
    Without, it is the *oracle* mix: the kinds of every task of the shuffled workload, those still to
    arrive (and those that will fail) included, known before the first is placed; no extender can know
    that.

    ``compute``: every GPU task also asks for its GPU share as a compute request, so a GPU takes
    tasks until their memory *or* their compute (rounded up to whole percent) is used up.

    ``window``: kube-scheduler sends the extender only the nodes its adaptive ``percentageOfNodesToScore``
    lets it find (497 of the trace's 1,213, from where its previous search stopped), as a cluster that does
    not set that option to 100 does; without, every node, as the published figures have it.

    ``unseen``: causal with no ``expected`` mix, the pods of each whole-node kind the mix weighs as a fresh
    extender's does (``core.placement.mixbook.UNSEEN_WEIGHT``; the tuning harness tries others)."""
    if expected is not None and not causal:
        raise ValueError("an expected mix is counted beside the pods seen: it needs the causal replay")
    rng = random.Random(seed)
    capacity_milli = 1000 * sum(n.gpus for n in nodes)
    workload = tuned(pods, capacity_milli=capacity_milli, ratio=RATIO, rng=rng)
    mix = None if causal else oracle_mix(nodes, workload)
    cluster: SimCluster
    if policy in (kubescheduler.NAME, kubescheduler.BEST_FIT_NAME):  # kube-scheduler's own DRA placement
        name = str(policy)
        devices = kubescheduler.first_fit if policy == kubescheduler.NAME else kubescheduler.best_fit
        cluster = kubescheduler.FirstFitCluster(
            nodes, mix=mix, rng=rng, links=links, expected=expected, compute=compute, devices=devices
        )
    elif isinstance(policy, str) and policy.startswith(allocator.PREFIX):  # DRA with the claim allocator
        name = policy
        named, alone, steer = allocator.policy_of(policy)
        cluster = allocator.AllocatorCluster(
            nodes,
            policy=policy_named(named),
            alone=alone,
            steer=steer,
            mix=mix,
            rng=rng,
            links=links,
            expected=expected,
            compute=compute,
        )
    else:
        chosen = policy if isinstance(policy, Policy) else policy_named(policy)
        name = chosen.name
        size = kubescheduler.nodes_to_find(len(nodes)) if window else 0
        cluster = SimCluster(
            nodes,
            policy=chosen,
            mix=mix,
            rng=rng,
            links=links,
            expected=expected,
            compute=compute,
            window=size,
            unseen=unseen,
        )
    typical = _typical(workload)
    allocation: list[float] = []
    frag_rate = 0.0
    arrived = placed = failed = multi_tasks = multi_gpus = multi_placed = 0
    last = round(RATIO * 100)
    for pod in workload:
        multi = pod.num_gpu > 1
        if multi:
            multi_tasks, multi_gpus = multi_tasks + 1, multi_gpus + pod.num_gpu
        if cluster.place(pod):
            placed += 1
            multi_placed += multi
        else:
            failed += 1
        arrived += pod.gpu_demand
        while len(allocation) <= last and len(allocation) <= 100 * arrived / capacity_milli:
            if len(allocation) == FRAG_AT:
                frag_rate = cluster.fragmentation_rate(typical)
            allocation.append(cluster.allocation)
    while len(allocation) <= last:
        allocation.append(cluster.allocation)
    unallocated, stranded = cluster.leftovers([p for p in workload if p.num_gpu == 1])
    return Replay(
        policy=name,
        seed=seed,
        allocation=allocation,
        frag_rate=frag_rate,
        multi_gpu_tasks=multi_tasks,
        multi_gpu_gpus=multi_gpus,
        multi_gpu_placed=multi_placed,
        placed=placed,
        failed=failed,
        unallocated_gpus=unallocated,
        stranded_gpus=stranded,
        gpu_failed=cluster.gpu_failed,
        gpu_failed_with_room=cluster.gpu_failed_with_room,
        links_seen=links,
        links=cluster.links,
    )


def oracle_mix(nodes: Sequence[TraceNode], workload: Sequence[TracePod]) -> RequestMix:
    """The kinds of every task of the workload, each with the GPU models its node affinity allows
    (gpu_spec), on the cluster's nodes by class, known before the first task arrived: what the placement
    figures were priced with before the replay counted the mix as an extender does (``openb-oracle*``)."""
    classes = Counter(node_class(inventory_of(n), model=n.model, cpu_allocatable=n.cpu_milli) for n in nodes)
    return RequestMix(((p.cpu_milli, p.memory_per_gpu, p.num_gpu, p.models or None) for p in workload), nodes=classes)


def trace_kinds(pods: Sequence[TracePod]) -> Counter[ModelKind]:
    """The kinds of a trace's tasks, counted as the extender's cache counts pods (``core.placement.mixbook.kind_of``)
    after running them all: what an operator's ``kubectl inspect gpushare --expected-mix`` would have
    written of that workload."""
    return Counter(request_kind(p.cpu_milli, p.memory_per_gpu, p.num_gpu, p.models or None) for p in pods)


def _typical(workload: Sequence[TracePod]) -> list[tuple[TracePod, float]]:
    """Each kind of task (CPU, GPUs, share, models) with its share of the workload's tasks."""
    kinds = Counter((p.cpu_milli, p.num_gpu, p.gpu_milli, p.models) for p in workload)
    return [
        (TracePod(name="typical", cpu_milli=c, memory_mib=0, num_gpu=n, gpu_milli=g, models=m), count / len(workload))
        for (c, n, g, m), count in kinds.items()
    ]
