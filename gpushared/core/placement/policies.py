"""Where on a node a pod goes, and how good the node is for it: the placement policies and their prices.

A policy prices each GPU that fits (``core.shared.verdicts``; lower is better) in the node's pricing context
(:class:`PricingContext`: the request mix, the node's free GPU memory and CPU, the pod's CPU); a node's
rank (:class:`NodeRank`) is, for a pod on several GPUs, how well the GPUs it would get there are linked,
then their price, then how unbalanced its CPU and GPU memory would be left. :func:`node_scores` turns
ranks into kube-scheduler's 0..10 scores.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from gpushared import contract
from gpushared.core.placement.pricing import PricingContext
from gpushared.core.shared.ledger import GpuVerdict, Ledger
from gpushared.core.shared.requests import PodRequest
from gpushared.core.shared.topology import choose_set, set_score, topology_of
from gpushared.core.shared.verdicts import MAX_MPS_CLIENTS, by_free, fitting

#: kube-scheduler's MaxExtenderPriority: extender scores are 0..10, multiplied by the extender's weight.
MAX_SCORE: Final = 10


class NodeRank(NamedTuple):
    """How a policy ranks a node for a pod: first, for a pod on several GPUs, how well the GPUs it would
    get there are linked (``links``: minus their ``set_score``, so lower is better as with prices; 0 for
    one GPU, or where the links are not known); then the policy's price; then, among nodes priced equal,
    how unbalanced the node would be left (``tiebreak``)."""

    price: float
    tiebreak: float = 0.0
    links: float = 0.0


#: The GPUs a pod is put on (as many as ``PodRequest.gpus``), in the order the policy ranked them.
Choice = tuple[GpuVerdict, ...]


@dataclass(frozen=True)
class Policy:
    """Where on a node a pod goes, and how good the node is for it.

    ``price`` prices putting ``need`` units on one fitting GPU (lower is better) in the node's pricing
    context; a node's price is its cheapest GPU's. Equal prices go to the GPU with less free memory, then
    the lower index, so choices are deterministic and, among equals, pack. A pod on several GPUs takes
    the best-linked set of the fitting GPUs (``core.shared.topology.choose_set``; among equally linked sets the one
    priced lowest in all, then first in that order; on a node whose links are not known, the first), and
    the node's price is theirs together: ``price_of_several``, or the sum of their prices when a policy's
    prices add up.
    """

    name: str
    price: Callable[[GpuVerdict, int, PricingContext], float]
    price_of_several: Callable[[Choice, int, PricingContext], float] | None = None
    #: whether ``price`` reads the mix: prices that do not are kept when a new mix is taken
    reads_mix: bool = False
    #: whether ``price`` reads the mix only through ``PricingContext.pressure``: its prices are kept when a
    #: new mix is taken with the same pressures (``RequestMix.pressures``; always, where no pod is pinned to
    #: GPU models), not worked out again for every node with every mix
    reads_pressure: bool = False
    #: whether ``price`` reads the node's and the pod's CPU: prices that do are kept per pod CPU request and
    #: until the node's CPU changes
    reads_cpu: bool = False
    #: whether ``price`` weighs kinds of pod by the nodes that can host them now, so the mix must be told
    #: what every node has left at each count (``RequestMix.with_rooms``); a cost only such policies pay
    reads_rooms: bool = False
    #: whether nodes priced equal are told apart by ``PricingContext.imbalance``
    balances: bool = False
    #: while the mix knows of fewer pods than this, a node none of whose GPU memory is taken comes after
    #: every node priced equal that has some taken (``WHOLE_NODE_LAST``)
    whole_until: float = 0.0
    #: how ``price`` moves with the GPU's free units, the node and the request being the same: 1 it always
    #: grows (best fit), -1 it always falls (spread), 0 neither or not known. Where it is known the GPU a
    #: one-GPU pod takes is the fitting one with the least (most) free memory, the lower index among equals,
    #: and only that one is priced: what prioritize pays for a request size not seen before is mostly this
    free_order: int = 0

    def gpu_order(self, verdict: GpuVerdict, need: int, context: PricingContext) -> tuple[float, int, int]:
        """Where a fitting GPU comes in the policy's choice: its price, then its free memory, then its index."""
        return (self.price(verdict, need, context), verdict.free, verdict.gpu.index)

    def choose(self, verdicts: Sequence[GpuVerdict], request: PodRequest, context: PricingContext) -> Choice | None:
        best = self._best(verdicts, request, context)
        return None if best is None else best[1]

    def price_node(
        self, verdicts: Sequence[GpuVerdict], request: PodRequest, context: PricingContext
    ) -> tuple[NodeRank, Choice] | None:
        """The node's rank for the pod, and the GPUs it would get there; None when too few GPUs fit."""
        best = self._best(verdicts, request, context)
        return None if best is None else self._ranked(best[0], best[1], request, context)

    def appraise(
        self, ledger: Ledger, request: PodRequest, context: PricingContext, *, max_mps_clients: int = MAX_MPS_CLIENTS
    ) -> tuple[NodeRank, Choice] | None:
        """:meth:`price_node` over the ledger's GPUs that fit (``fitting``), what prioritize and the replay
        price. For a one-GPU pod under a policy whose price follows free memory (``free_order``) the GPU it
        takes is found with one search of the GPUs in order of free memory (``by_free``, kept on the ledger),
        not by judging each: a request size not priced before costs each node little more than its price. A
        property test holds the two to the same rank and GPU."""
        need = request.per_gpu
        if request.gpus != 1 or not self.free_order or need <= 0 or request.compute_request:
            # (a compute request: the GPU with the right free memory may have no compute left)
            return self.price_node(fitting(ledger, request, max_mps_clients=max_mps_clients), request, context)
        frees, ordered = by_free(ledger, mps=request.mps, max_mps_clients=max_mps_clients)
        at = bisect_left(frees, need)  # the tightest with room: the least free, then the lowest index
        if at == len(frees):
            return None
        if self.free_order < 0:
            at = bisect_left(frees, frees[-1])  # the emptiest: the most free, then the lowest index
        verdict = ordered[at]
        return self._ranked(self.price(verdict, need, context), (verdict,), request, context)

    def _ranked(
        self, price: float, chosen: Choice, request: PodRequest, context: PricingContext
    ) -> tuple[NodeRank, Choice]:
        tiebreak = context.imbalance(request.total) if self.balances else 0.0
        if self.whole_until and context.mix_pods < self.whole_until and context.whole:  # (fgd alone reads it)
            tiebreak += WHOLE_NODE_LAST
        links = 0.0
        if request.gpus > 1:
            links = -float(set_score((v.gpu.index for v in chosen), topology_of(context.ledger.inventory)))
        return NodeRank(price, tiebreak, links), chosen

    def _best(
        self, verdicts: Sequence[GpuVerdict], request: PodRequest, context: PricingContext
    ) -> tuple[float, Choice] | None:
        """The fitting GPUs that come first, with their price (each GPU priced once: fgd's prices are not free)."""
        need, gpus = request.per_gpu, request.gpus
        if gpus == 1 and self.free_order:
            fits = [v for v in verdicts if v.reason is None]
            if not fits:
                return None
            sign = self.free_order
            verdict = min(fits, key=lambda v: (sign * v.free, v.gpu.index))
            return self.price(verdict, need, context), (verdict,)
        ordered = [(self.gpu_order(v, need, context), v) for v in verdicts if v.fits]
        if len(ordered) < gpus:  # gpus >= 1: none fitting is too few
            return None
        if gpus == 1:
            order, verdict = min(ordered, key=lambda pair: pair[0])
            return order[0], (verdict,)
        ordered.sort(key=lambda pair: pair[0])
        # The best-linked set of the GPUs with room, the policy's order breaking ties (core/shared/topology.py);
        # a node whose links are not known gets the policy's first GPUs.
        topology = topology_of(context.ledger.inventory)
        if topology.known:
            by_index = {verdict.gpu.index: (order, verdict) for order, verdict in ordered}
            prices = {index: order[0] for index, (order, _) in by_index.items()}
            top = [by_index[i] for i in choose_set([v.gpu.index for _, v in ordered], gpus, topology, prices)]
        else:
            top = ordered[:gpus]
        chosen = tuple(verdict for _, verdict in top)
        if self.price_of_several is None:
            return sum(order[0] for order, _ in top), chosen
        return self.price_of_several(chosen, need, context), chosen


def best_rank(keys: Iterable[NodeRank | None]) -> NodeRank | None:
    """The best of ``keys``: the best-linked, then among those the lowest price, then among the nodes at that
    price the least imbalance."""
    known = [k for k in keys if k is not None]
    if not known:
        return None
    # lists, not generators, into min(): a thousand keys a call (node_scores)
    links = min([k.links for k in known])
    top_links = links + EQUAL_PRICE
    cheapest = min([k.price for k in known if k.links <= top_links])
    top_price = cheapest + EQUAL_PRICE
    tiebreak = min([k.tiebreak for k in known if k.links <= top_links and k.price <= top_price])
    return NodeRank(cheapest, tiebreak, links)


def ties(key: NodeRank, best: NodeRank) -> bool:
    """Whether a node ranked ``key`` is as good as the best (up to float sums): it earns MAX_SCORE."""
    return (
        key.links <= best.links + EQUAL_PRICE
        and key.price <= best.price + EQUAL_PRICE
        and key.tiebreak <= best.tiebreak + EQUAL_PRICE
    )


def best_nodes(keys: Sequence[NodeRank | None]) -> list[int]:
    """The positions of the nodes ranked as good as the best: those :func:`node_scores` gives MAX_SCORE.

    With the extender's weight (100, deploy/), one step of its score outweighs every in-tree score together,
    so kube-scheduler's choice always falls among these; a filter that keeps only them leaves it the same
    choice without a prioritize call (``--rank-in-filter``)."""
    best = best_rank(keys)
    if best is None:
        return []
    return [i for i, key in enumerate(keys) if key is not None and ties(key, best)]


def node_scores(keys: Sequence[NodeRank | None]) -> list[int]:
    """Extender scores (0..MAX_SCORE) for nodes ranked ``keys``: the best get MAX_SCORE and nobody else
    does; nodes as well linked and at the best price but less balanced MAX_SCORE-1; the rest as well
    linked 0..MAX_SCORE-1 by where their price lies between the cheapest and the dearest of them; nodes
    whose GPUs would be less well linked no more than the lowest of those, by how well linked. Relative,
    because kube-scheduler only compares, and an extender has 11 levels: absolute buckets would tie nodes
    that the policy tells apart. Nodes that cannot take the pod get 0.

    One pass over the keys with the bounds in locals: prioritize scores a thousand candidates a call, and
    a function call per key was half of a call that found every rank kept (tests/unit/test_placement.py
    holds it to a plain transcription of the rules above)."""
    best = best_rank(keys)
    scores = [0] * len(keys)
    if best is None:
        return scores
    top_links = best.links + EQUAL_PRICE
    top_price = best.price + EQUAL_PRICE
    top_tiebreak = best.tiebreak + EQUAL_PRICE
    worst = max(key[0] for key in keys if key is not None and key[2] <= top_links)
    span = worst - best.price
    less_linked: list[tuple[int, float]] = []  # (position, links): multi-GPU pods only
    for i, key in enumerate(keys):
        if key is None:
            continue
        price, tiebreak, links = key
        if links > top_links:
            less_linked.append((i, links))
            continue
        if price <= top_price:
            scores[i] = MAX_SCORE if tiebreak <= top_tiebreak else MAX_SCORE - 1
        else:
            scores[i] = math.floor((MAX_SCORE - 1) * (worst - price) / span + EQUAL_PRICE)
    if less_linked:
        less = {i for i, _ in less_linked}
        lowest = min(scores[i] for i, key in enumerate(keys) if key is not None and i not in less)
        worst_links = max(links for _, links in less_linked)
        for i, links in less_linked:
            scores[i] = min(lowest, math.floor((MAX_SCORE - 1) * (worst_links - links) / (worst_links - best.links)))
    return scores


#: Prices closer than this are equal (they are sums of float shares).
EQUAL_PRICE: Final = 1e-9

#: What an untouched node adds to its tiebreak while fgd's mix is young (``Policy.whole_until``): more than
#: any imbalance (at most 1), so among nodes priced equal the untouched come last.
WHOLE_NODE_LAST: Final = 2.0

#: Until its mix knows of this many pods, fgd keeps untouched nodes for last among nodes priced equal. A
#: fresh extender with no expected mix has seen no big kind yet: its fragment prices none, and the balance
#: of CPU and GPU sends small pods to the big nodes, where they change the shares least; the few nodes that
#: could host a pod of 8 GPUs and 120 CPUs were broken before the first came (on multigpu30, 13
#: such pods refused before the cluster was 88 % full; none under binpack). Kept untouched, those nodes
#: wait until the mix has seen enough to weigh the big kinds by their scarcity. The expected mix counts as
#: EXPECTED_WEIGHT (1,000) pods: with it, this never applies. Chosen by scripts/tune_placement.py with no
#: expected mix; figures: bench/results/tuning-whole-until.json.
FGD_WHOLE_UNTIL: Final = 250.0

#: Levels the fgd policy prices in: kube-scheduler's MaxNodeScore, to which the paper's FGD score plugin
#: cuts a sigmoid of the fragment's growth.
FGD_LEVELS: Final = 100


#: What a node's GPU model being wanted in full by pinned pods adds to the price of placing a pod that may
#: run anywhere there: for binpack in GPUs left, for fgd in its levels. A pod that may run anywhere then goes
#: elsewhere unless that costs more than this. binpack weighs the pressure counted from the pinned pods seen
#: (``PricingContext.pressure``): at 512 it is a strict order, so any pinned pod seen keeps the model last.
#: fgd weighs the pressure projected from their share of the demand and what each model has left
#: (``PricingContext.projected_pressure``): the count starts near 0 while few pinned pods have come, and fgd
#: had filled the pinned models before it grew (gpuspec05, seed 42: 174 GPU tasks refused before 88 %
#: full, most pinned to T4). The projected pressure is at most 1 and grows with the pinned share of the
#: demand, so fgd's weight is what a model pinned pods want in full costs: at 32 of 100 levels it stays
#: theirs as pinning grows (at 8, fgd fell 1.6 below binpack with half the GPU pods pinned), while under
#: light pinning the pressure, and so the term, stays small. Both chosen by scripts/tune_placement.py;
#: figures: bench/results/tuning-placement.json (binpack), bench/results/tuning-pinning.json (fgd, held
#: against binpack on traces with 30 and 50 % of GPU pods pinned; scripts/derive_pinned_traces.py).
BINPACK_PRESSURE: Final = 512.0
FGD_PRESSURE: Final = 32.0


def _fgd_levels(growth: float) -> float:
    """The growth of the node's expected fragment, in GPUs (of the first GPU's size), through a sigmoid cut to
    FGD_LEVELS: growths that close are equal. The mix is an estimate, and telling its hundredths of a GPU
    apart costs more than it wins; among equals the balance of CPU and GPU decides (docs/benchmarks.md)."""
    if growth >= _FLAT:
        return -0.0
    return -float(math.floor(FGD_LEVELS / (1.0 + math.exp(growth))))


#: A growth past which the sigmoid is 0 levels (and ``math.exp`` would overflow, near 710): a kind that only
#: a few nodes can host now weighs on them by the cluster's nodes per such node, thousands of times its share.
_FLAT: Final = 50.0


#: How much a GPU's own leftover weighs beside its node's: only where nodes' leftovers are equal.
TIEBREAK: Final = 1e-6


def _node_left(context: PricingContext, taken: int) -> float:
    """What the node would have left, in GPUs: its free GPU memory after ``taken`` units, plus, where its CPU
    is known, its CPU left counted in the node's CPU per GPU, the two weighed alike (the FGD paper's
    BestFit: half CPU, half GPU)."""
    gpus = len(context.ledger.inventory.gpus) or 1
    per_gpu = context.capacity / gpus or 1
    gpu_left = (context.free_total - taken) / per_gpu
    cpu, cpu_free = context.cpu, context.cpu_free
    if cpu is None or cpu_free is None or cpu.allocatable <= 0:
        return gpu_left
    return 0.5 * gpu_left + 0.5 * (cpu_free - context.pod_cpu) / (cpu.allocatable / gpus)


def binpack(pressure: float = BINPACK_PRESSURE) -> Policy:
    """Binpack with a pinned model's ``pressure`` worth that many GPUs left (the tuning harness,
    scripts/tune_placement.py, tries others; BINPACK is the one that ships)."""

    def price(verdict: GpuVerdict, need: int, context: PricingContext) -> float:
        """What the node would have left (and its model's pressure), then the GPU's free memory left (a
        fraction below one unit)."""
        left = _node_left(context, need) + pressure * context.pressure
        return left + TIEBREAK * (verdict.free - need) / (context.capacity + 1)

    def price_of_several(verdicts: Choice, need: int, context: PricingContext) -> float:
        left = sum(verdict.free - need for verdict in verdicts)
        taken = need * len(verdicts)
        node_left = _node_left(context, taken) + pressure * context.pressure
        return node_left + TIEBREAK * left / (len(verdicts) * (context.capacity + 1))

    return Policy(
        name="binpack",
        price=price,
        price_of_several=price_of_several,
        reads_cpu=True,
        reads_pressure=True,
        free_order=1,
    )


def fgd(pressure: float = FGD_PRESSURE, whole_until: float = FGD_WHOLE_UNTIL) -> Policy:
    """fgd with a pinned model's projected pressure worth ``pressure`` of its levels (``FGD_PRESSURE``),
    keeping untouched nodes for last among equals until the mix knows of ``whole_until`` pods."""

    def price(verdict: GpuVerdict, need: int, context: PricingContext) -> float:
        levels = _fgd_levels(context.growth((verdict,), need) / verdict.gpu.memory)
        return levels + pressure * context.projected_pressure

    def price_of_several(verdicts: Choice, need: int, context: PricingContext) -> float:
        levels = _fgd_levels(context.growth(verdicts, need) / verdicts[0].gpu.memory)
        return levels + pressure * context.projected_pressure

    return Policy(
        name="fgd",
        price=price,
        price_of_several=price_of_several,
        reads_mix=True,
        reads_rooms=True,
        reads_cpu=True,
        balances=True,
        whole_until=whole_until,
    )


#: Best fit of the node, then of the GPU: the node left with the least free GPU memory after placement, and
#: on it the GPU left with the least. Aliyun's binpack fits the GPU alone, so a one-GPU pod that fills a GPU
#: exactly ties on every node with an empty GPU, and an empty 8-GPU node is as good as a nearly full one:
#: whole nodes are gone before the tasks that need them arrive. The FGD paper's BestFit scores the node's
#: leftovers, as here (docs/benchmarks.md, "Placement quality"). A pod that may run on any GPU model is
#: kept off the models that pods pinned to them will want (``BINPACK_PRESSURE``): packing those first leaves
#: the pinned pods nowhere to go.
BINPACK: Final = binpack()
#: The GPU left with the most free memory.
SPREAD: Final = Policy(name="spread", price=lambda v, need, context: float(need - v.free), free_order=-1)
#: Fragmentation gradient descent: the GPU and node where the expected fragment of the node's free GPU
#: memory, for the mix of pods seen (each kind weighed by how scarce the nodes that could host it are) and
#: the CPU left, grows least (gpushared.core.placement.fragmentation); among
#: equal growths the node whose CPU and GPU stay most balanced, then best fit; while the mix knows of fewer
#: than FGD_WHOLE_UNTIL pods, untouched nodes come after every node priced equal that has some GPU memory
#: taken. A pod that may run anywhere pays for a GPU model that pinned pods will want what their share of
#: the demand projects (``FGD_PRESSURE``). With no mix yet it is best fit among balanced nodes, untouched
#: nodes last.
FGD: Final = fgd()


def _balanced_price(verdict: GpuVerdict, need: int, context: PricingContext) -> float:
    """Fewest pods first (whole steps), then the most free memory left (a fraction below one step)."""
    return context.ledger.sharers(verdict.gpu.index) + (need - verdict.free) / (verdict.gpu.memory + 1)


#: The GPU shared by the fewest pods, then the one with the most free memory: each pod gets as much of a GPU
#: to itself as the node allows (interactive and development nodes, where pods come and go and each
#: wants a GPU as idle as possible). A node's price is its least shared GPU's, so nodes balance too.
BALANCED: Final = Policy(name="balanced", price=_balanced_price)

POLICIES: Final = {policy.name: policy for policy in (BINPACK, SPREAD, FGD, BALANCED)}


def policy_named(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise contract.ContractError(
            key="policy", value=name, reason=f"unknown placement policy; choose one of {', '.join(POLICIES)}"
        ) from None
