"""Where the claim allocator puts a pod's pending DRA claims: the node, and each request's GPUs there.

kube-scheduler by itself allocates a claim first fit on a node its default scores chose
(``replay.kubescheduler``). The claim allocator chooses instead, with the extender's own policies over the
same ledgers: every node the pod may go to is ranked by the policy (``Policy.appraise``, as prioritize ranks
a gpu-mem pod), the best rank wins, kube-scheduler's own score of the node breaks ties, then the name. So a
pod whose claims ask what a gpu-mem pod asks is placed where the extender would place that pod.

What a pod asks is the asks of its pending claims (``core.placement.claims.asks.ClaimAsk``), in the node's memory
unit (bytes rounded up to whole units, as the slice's ``validRange`` steps round them):

- **one shape** (every device the same memory, compute and MPS, and NVLink asked by at most one claim): one
  request on as many GPUs, priced as the extender prices a pod with ``gpu-count``; NVLink asked: the GPUs of
  one NVLink domain only, the best domain of the node;
- **several shapes** (requests of different sizes, claims that differ in MPS, GPUs taken whole): each part
  in turn, the largest first, on the node's ledger with the parts before it counted; the node's rank is the
  sum of the parts' prices. A GPU is never given to two devices of one pod's claims.

A GPU taken whole (a request that names no memory) is one with nothing on it; it consumes all of its
memory. Only GPUs that are devices of the node's ResourceSlice are given out (``CandidateNode.devices``).
Pure: the component builds each node's :class:`CandidateNode` and writes what :func:`choose` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar, cast

from gpushared.contract import ComputeShare, MemoryUnit
from gpushared.core.placement.claims.asks import ClaimAsk
from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.policies import Choice, NodeRank, Policy, best_rank, ties
from gpushared.core.placement.pricing import NodeCpu, PricingContext
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.core.shared.verdicts import fitting

#: A node the pod may go to, as a caller of :func:`choose` keeps it.
C = TypeVar("C")


@dataclass(frozen=True)
class Setting:
    """What the policy weighs beside the GPUs of one node (``core.placement.pricing.PricingContext``)."""

    mix: RequestMix | None = None
    cpu: NodeCpu | None = None
    pod_cpu: int = 0
    model: str | None = None
    pinned: bool = False

    def context(self, ledger: Ledger, *, pod_compute: int) -> PricingContext:
        given = {} if self.mix is None else {"mix": self.mix}
        return PricingContext(
            ledger,
            cpu=self.cpu,
            pod_cpu=self.pod_cpu,
            model=self.model,
            pinned=self.pinned,
            pod_compute=pod_compute,
            **given,
        )


@dataclass(frozen=True)
class CandidateNode:
    """A node the pod may go to: its ledger (its claims and pods counted), and what it publishes."""

    name: str
    ledger: Ledger
    #: GPU index -> its device's name in the node's ResourceSlice: the only GPUs that may be given out
    devices: Mapping[int, str]
    #: GPU index -> its NVLink domain (absent: joined to none)
    domains: Mapping[int, str] = field(default_factory=dict)
    setting: Setting = Setting()
    #: kube-scheduler's own score of the node for the pod (higher is better): breaks the policy's ties
    kube_score: float = 0.0


class Part(NamedTuple):
    """Devices of one request of one claim, in the node's unit (``units`` None: each GPU whole)."""

    claim: int
    request: str
    gpus: int
    units: int | None
    compute: int
    mps: bool
    linked: bool


@dataclass(frozen=True)
class Pick:
    """One device given to one request of one claim: a GPU, and what of it the claim consumes."""

    claim: int
    request: str
    index: int
    device: str
    units: int
    compute: int


@dataclass(frozen=True)
class ClaimChoice:
    node: str
    rank: NodeRank
    picks: tuple[Pick, ...]


@dataclass(frozen=True)
class NoRoom:
    """Why no node can take the pod's claims now: the pod stays gated and is tried again."""

    reason: str


class Resources(NamedTuple):
    """A node's CPU (milli) and memory (bytes, or the replay's MiB): what pods may request, and request."""

    cpu_allocatable: int
    cpu_requested: int
    memory_allocatable: int
    memory_requested: int


def kube_resource_score(node: Resources | None, *, pod_cpu: int, pod_memory: int) -> float:
    """kube-scheduler's own resource scores of the node with the pod on it, as it adds them to an extender's
    (LeastAllocated plus BalancedAllocation over CPU and memory, weight 1 each, the formula the replay's
    published figures use): the claim allocator's tie-break between nodes its policy ranks equal, since it
    chooses the node where kube-scheduler would have weighed them. 0 where the node's resources are unknown."""
    if node is None or node.cpu_allocatable <= 0 or node.memory_allocatable <= 0:
        return 0.0
    # 1 minus what is left after the pod, as a fraction: the replay's figures are worked out in this order
    cpu = 1 - (node.cpu_allocatable - node.cpu_requested - pod_cpu) / node.cpu_allocatable
    memory = 1 - (node.memory_allocatable - node.memory_requested - pod_memory) / node.memory_allocatable
    return float(int((1 - (cpu + memory) / 2) * 100) + int((1 - abs(cpu - memory)) * 100))


def parts(asks: Sequence[ClaimAsk], unit: MemoryUnit) -> list[Part]:
    """The pod's asks in ``unit``, the largest first (whole GPUs first of all): the order they are placed in."""
    unit_bytes = unit.to_bytes(1)
    found = [
        Part(
            claim=number,
            request=request.request,
            gpus=request.count,
            units=None if request.memory is None else -(-request.memory // unit_bytes),
            compute=request.compute,
            mps=ask.mps,
            linked=ask.linked,
        )
        for number, ask in enumerate(asks)
        for request in ask.requests
    ]
    return sorted(found, key=lambda p: (p.units is not None, -(p.units or 0), -p.gpus, p.claim, p.request))


def may_fit(asks: Sequence[ClaimAsk], ledger: Ledger, given: Mapping[int, str]) -> bool:
    """Whether the claims could fit the node's published GPUs, judged generously: enough GPUs each with room
    for the smallest part's memory and compute (or empty, for whole GPUs), as if each could take any part.
    Never False where ``place_on`` finds room; cheap enough to ask of every node for every pod that
    kube-scheduler may be allocating for (the allocator's fence)."""
    pieces = parts(asks, ledger.unit)
    if not pieces:
        return False
    sized = [p.units for p in pieces if p.units is not None]
    smallest = min(sized) if sized else None
    whole = len(sized) < len(pieces)
    compute = min(p.compute for p in pieces)
    room = 0
    for gpu in ledger.inventory.gpus:
        if gpu.index not in given or 100 - ledger.compute_used(gpu.index) < compute:
            continue
        used = ledger.used(gpu.index)
        if (smallest is not None and gpu.memory - used >= smallest) or (whole and used == 0):
            room += 1
    return room >= sum(p.gpus for p in pieces)


def first(tied: Sequence[ClaimChoice]) -> ClaimChoice:
    """Of placements nothing tells apart, the first node by name."""
    return min(tied, key=lambda choice: choice.node)


def choose(
    asks: Sequence[ClaimAsk],
    candidates: Sequence[C],
    policy: Policy,
    *,
    pick: Callable[[Sequence[ClaimChoice]], ClaimChoice] = first,
    place: Callable[[C], ClaimChoice | None] | None = None,
    kube_score: Callable[[ClaimChoice], float] | None = None,
) -> ClaimChoice | NoRoom:
    """The best node for the pod's claims and the devices each request gets there; or why none fits.

    Every caller decides here: the allocator, the trace replay and the tests. ``place`` works out the claims'
    placement on one candidate (default: :func:`place_on`, for candidates that are :class:`CandidateNode`;
    the allocator and the replay keep placements between pods and pass their own); ``kube_score`` is
    kube-scheduler's score of a choice's node (default: the candidate's ``kube_score``)."""
    if not asks:
        return NoRoom("the pod has no pending claim of this driver")
    if not candidates:
        return NoRoom("no node publishes this driver's GPUs and passes the pod's CPU, memory and node selection")
    if place is None:
        place = cast("Callable[[C], ClaimChoice | None]", lambda candidate: place_on(asks, candidate, policy))
    if kube_score is None:
        by_name = {c.name: c for c in cast("Sequence[CandidateNode]", candidates)}
        kube_score = lambda choice: by_name[choice.node].kube_score  # noqa: E731
    return _best_of(asks, [place(candidate) for candidate in candidates], kube_score=kube_score, pick=pick)


def _best_of(
    asks: Sequence[ClaimAsk],
    placed: Iterable[ClaimChoice | None],
    *,
    kube_score: Callable[[ClaimChoice], float],
    pick: Callable[[Sequence[ClaimChoice]], ClaimChoice] = first,
) -> ClaimChoice | NoRoom:
    """The best of the nodes' placements (None: the claims do not fit there): the best rank as
    ``policies.best_rank`` has it (the best-linked, then the lowest price, then among prices that
    ``policies.ties`` calls equal the lowest tie-break), then kube-scheduler's highest ``kube_score`` for the
    node (asked of the tied only); ``pick`` chooses among what is still equal (kube-scheduler draws at random
    among equal scores; tests and the default take the first name)."""
    found = [choice for choice in placed if choice is not None]
    best = best_rank(choice.rank for choice in found)
    if best is None:
        devices = sum(ask.devices for ask in asks)
        return NoRoom(f"no node has room for the {devices} device(s) the pod's claims ask for")
    tied = [choice for choice in found if ties(choice.rank, best)]
    if len(tied) > 1:
        scored = [(kube_score(choice), choice) for choice in tied]
        top = max(score for score, _ in scored)
        tied = [choice for score, choice in scored if score == top]
    return pick(tied)


def place_on(asks: Sequence[ClaimAsk], candidate: CandidateNode, policy: Policy) -> ClaimChoice | None:
    """The pod's claims on one node: the devices each request gets and the node's rank; None if they do not fit."""
    ledger = candidate.ledger
    pieces = parts(asks, ledger.unit)
    shapes = {(p.units, p.compute, p.mps) for p in pieces}
    linked = any(p.linked for p in pieces)
    if len(shapes) == 1 and pieces[0].units is not None and (not linked or len(asks) == 1):
        return _place_one_shape(pieces, candidate, policy)
    return _place_in_turn(pieces, candidate, policy)


def _place_one_shape(pieces: Sequence[Part], candidate: CandidateNode, policy: Policy) -> ClaimChoice | None:
    first = pieces[0]
    assert first.units is not None
    request = _request(first.units, sum(p.gpus for p in pieces), compute=first.compute, mps=first.mps)
    priced = _price(candidate, candidate.ledger, request, policy, linked=first.linked)
    if priced is None:
        return None
    rank, chosen = priced
    return ClaimChoice(candidate.name, rank, tuple(_picks(pieces, chosen, candidate, first.units)))


def _place_in_turn(pieces: Sequence[Part], candidate: CandidateNode, policy: Policy) -> ClaimChoice | None:
    """Each part on the node's ledger with the parts before it counted (a copy: the real one is read only)."""
    ledger = Ledger.build(candidate.ledger.inventory, candidate.ledger.holdings())
    taken: set[int] = set()
    picks: list[Pick] = []
    price = tiebreak = links = 0.0
    for number, part in enumerate(pieces):
        priced = _price_part(part, candidate, ledger, policy, taken)
        if priced is None:
            return None
        rank, chosen, units = priced
        price, tiebreak, links = price + rank.price, rank.tiebreak, links + rank.links
        for pick in _picks([part], chosen, candidate, units):
            picks.append(pick)
            taken.add(pick.index)
        ledger.add(
            Holding(
                uid=f"part-{number}",
                namespace="",
                name="",
                gpus={v.gpu.index: units for v in chosen},
                mps=part.mps,
                assigned=True,
                compute=part.compute,
            )
        )
    return ClaimChoice(candidate.name, NodeRank(price, tiebreak, links), tuple(picks))


def _price_part(
    part: Part, candidate: CandidateNode, ledger: Ledger, policy: Policy, taken: set[int]
) -> tuple[NodeRank, Choice, int] | None:
    """One part's GPUs on the node as it is with the earlier parts counted, never a GPU already taken."""
    if part.units is not None:
        request = _request(part.units, part.gpus, compute=part.compute, mps=part.mps)
        priced = _price(candidate, ledger, request, policy, linked=part.linked, taken=taken)
        return None if priced is None else (*priced, part.units)
    # Whole GPUs: those with nothing on them, priced per GPU size (a node of one size prices one request).
    best: tuple[NodeRank, Choice, int] | None = None
    for size in sorted({gpu.memory for gpu in ledger.inventory.gpus if gpu.memory > 0}):
        empty = {
            gpu.index
            for gpu in ledger.inventory.gpus
            if gpu.memory == size and ledger.used(gpu.index) == 0 and ledger.sharers(gpu.index) == 0
        }
        request = _request(size, part.gpus, compute=part.compute, mps=part.mps)
        priced = _price(candidate, ledger, request, policy, linked=part.linked, taken=taken, only=empty)
        if priced is not None and (best is None or (priced[0].links, priced[0].price) < (best[0].links, best[0].price)):
            best = (*priced, size)
    return best


def _price(
    candidate: CandidateNode,
    ledger: Ledger,
    request: PodRequest,
    policy: Policy,
    *,
    linked: bool,
    taken: set[int] | None = None,
    only: set[int] | None = None,
) -> tuple[NodeRank, Choice] | None:
    """The policy's rank of the node and its GPUs for ``request``: over the slice's GPUs not ``taken`` (and in
    ``only``, where given); NVLink asked, over one domain's GPUs, the best domain."""
    context = candidate.setting.context(ledger, pod_compute=request.compute_request)
    devices = candidate.devices
    every = len(devices) == len(ledger.inventory.gpus) and not taken and only is None
    if every and not linked:  # the extender's own path (the same rank and GPUs as prioritize and bind)
        return policy.appraise(ledger, request, context)
    verdicts = [
        v
        for v in fitting(ledger, request)
        if v.gpu.index in devices and (not taken or v.gpu.index not in taken) and (only is None or v.gpu.index in only)
    ]
    if not linked:
        return policy.price_node(verdicts, request, context)
    best: tuple[NodeRank, Choice] | None = None
    for domain in sorted(set(candidate.domains.values())):
        inside = [v for v in verdicts if candidate.domains.get(v.gpu.index) == domain]
        priced = policy.price_node(inside, request, context)
        if priced is not None and (best is None or priced[0] < best[0]):
            best = priced
    return best


def _picks(pieces: Sequence[Part], chosen: Choice, candidate: CandidateNode, units: int) -> list[Pick]:
    """The chosen GPUs dealt to the parts in order (one shape: any device may go to any of its requests)."""
    indices = [v.gpu.index for v in chosen]
    picks: list[Pick] = []
    for part in pieces:
        for _ in range(part.gpus):
            index = indices[len(picks)]
            picks.append(Pick(part.claim, part.request, index, candidate.devices[index], units, part.compute))
    return picks


def _request(units: int, gpus: int, *, compute: int, mps: bool) -> PodRequest:
    """A part as the extender's pod request: ``units`` on each of ``gpus`` GPUs."""
    return PodRequest(
        containers=(ContainerRequest(name="claim", amount=units * gpus, gpus=gpus),),
        mps=mps,
        compute=ComputeShare(request=compute) if compute else None,
    )


def holdings_of(choice: ClaimChoice, asks: Sequence[ClaimAsk]) -> list[Holding]:
    """What the claims hold on the chosen node once allocated, one holding per request of each claim (its
    UID ``<claim UID>/<request>``, as ``core.dra.allocated.claim_holdings`` names them per device): counted in
    the allocator's book before the claim watch shows the allocation (assumed)."""
    result: list[Holding] = []
    for number, ask in enumerate(asks):
        for request in ask.requests:
            mine = [p for p in choice.picks if p.claim == number and p.request == request.request]
            if mine:
                result.append(
                    Holding(
                        uid=f"{ask.uid}/{request.request}",
                        namespace=ask.namespace,
                        name=f"resourceclaim/{ask.name}",
                        gpus={p.index: p.units for p in mine},
                        mps=ask.mps,
                        assigned=True,
                        compute=request.compute,
                    )
                )
    return result
