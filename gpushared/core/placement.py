"""Choosing a GPU for a pod, scoring nodes, and the annotations that record the choice.

Every caller goes through :func:`judge`, so the extender's filter reasons, its bind and the trace replay
cannot disagree about what fits. A policy only prices the GPUs that fit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from gpushared import contract
from gpushared.contract import Allocation, ContainerShares, GpuInfo, GpuShare
from gpushared.core.fragmentation import RequestMix
from gpushared.core.ledger import GpuMode, Holding, Ledger
from gpushared.core.requests import PodRequest

#: Clients one MPS server takes on SM 7.0+ (16 before Volta). Each CUDA process is one client.
MAX_MPS_CLIENTS: Final = 48
#: kube-scheduler's MaxExtenderPriority: extender scores are 0..10, multiplied by the extender's weight.
MAX_SCORE: Final = 10


@dataclass(frozen=True)
class GpuVerdict:
    """Whether one GPU can take the pod; ``reason`` says why not, in words a person acts on."""

    gpu: GpuInfo
    free: int
    reason: str | None

    @property
    def fits(self) -> bool:
        return self.reason is None


def _refusal(ledger: Ledger, gpu: GpuInfo, *, mps: bool, max_mps_clients: int) -> str | None:
    """Why a pod of this kind (MPS or not) may not use ``gpu`` whatever it asks for; None when it may."""
    mode = ledger.mode(gpu.index)
    if not gpu.healthy:
        return f"GPU {gpu.index} is unhealthy"
    if mps and not gpu.mps_capable:
        return f"GPU {gpu.index} runs no MPS server"
    if mps and mode is GpuMode.SHARED:
        return f"GPU {gpu.index} is shared by pods without MPS"
    if not mps and mode is GpuMode.MPS:
        return f"GPU {gpu.index} serves MPS pods"
    if mps and ledger.mps_clients(gpu.index) >= max_mps_clients:
        return f"GPU {gpu.index} has {ledger.mps_clients(gpu.index)} MPS clients, the most it takes"
    return None


def judge(ledger: Ledger, request: PodRequest, *, max_mps_clients: int = MAX_MPS_CLIENTS) -> list[GpuVerdict]:
    """Whether each GPU of the node has room for the pod's share of it (``PodRequest.per_gpu``)."""
    unit = ledger.unit.value
    need = request.per_gpu
    each = f" on each of {request.gpus} GPUs" if request.gpus > 1 else ""
    verdicts = []
    for gpu in ledger.inventory.gpus:
        free = ledger.free(gpu)
        reason = (
            "pod requests no GPU memory"
            if need <= 0
            else _refusal(ledger, gpu, mps=request.mps, max_mps_clients=max_mps_clients)
        )
        if reason is None and free < need:
            reason = f"GPU {gpu.index} has {max(free, 0)} {unit} free, pod needs {need} {unit}{each}"
        verdicts.append(GpuVerdict(gpu=gpu, free=free, reason=reason))
    return verdicts


def fitting(ledger: Ledger, request: PodRequest, *, max_mps_clients: int = MAX_MPS_CLIENTS) -> list[GpuVerdict]:
    """The verdicts of :func:`judge` that fit, without working out why the others do not: what pricing a
    node needs, a thousand nodes at a time (a property test holds the two together)."""
    need = request.per_gpu
    if need <= 0:
        return []
    fits = []
    for gpu in ledger.inventory.gpus:
        free = ledger.free(gpu)
        if free >= need and _refusal(ledger, gpu, mps=request.mps, max_mps_clients=max_mps_clients) is None:
            fits.append(GpuVerdict(gpu=gpu, free=free, reason=None))
    return fits


def most_free(ledger: Ledger, *, mps: bool, gpus: int = 1, max_mps_clients: int = MAX_MPS_CLIENTS) -> int:
    """The most units free on each of ``gpus`` GPUs that a pod of this kind (MPS or not) may take; -1 when
    fewer may.

    :func:`judge` finds enough GPUs that fit a request exactly when its share per GPU is positive and at most
    this, so a filter can answer from one number per node, kept until the ledger changes, instead of judging
    every GPU of every candidate on every call."""
    usable = sorted(
        (
            ledger.free(gpu)
            for gpu in ledger.inventory.gpus
            if _refusal(ledger, gpu, mps=mps, max_mps_clients=max_mps_clients) is None
        ),
        reverse=True,
    )
    return usable[gpus - 1] if len(usable) >= gpus else -1


def idle_gpu_mib(ledger: Ledger | None) -> int:
    """The GPU memory (MiB) free on the healthy GPUs of a node: what a pod that asks for none sits beside.

    Such a pod takes CPU and memory, and a node short of them leaves its free GPU memory to nobody; so pods
    without a GPU go where the least is free (nothing on a node without GPUs). On the Alibaba trace, where
    one task in eight uses no GPU, this decides more than the choice among GPUs does (docs/benchmarks.md).
    A node whose GPUs the extender cannot read (None) counts as none free: it offers no GPU to strand.
    """
    if ledger is None:
        return 0
    mib = ledger.unit.mib
    return sum(max(ledger.free(gpu), 0) * mib for gpu in ledger.inventory.gpus if gpu.healthy)


def explain(verdicts: list[GpuVerdict], *, gpus: int = 1) -> str:
    """One line for a node that cannot take a pod on ``gpus`` GPUs (the extender's FailedNodes entry)."""
    if not verdicts:
        return "node has no GPUs"
    reasons = dict.fromkeys(v.reason for v in verdicts if v.reason)
    fit = sum(v.fits for v in verdicts)
    if fit:  # some GPUs fit, not enough of them
        return "; ".join((f"{fit} of the node's GPUs have room, the pod needs {gpus}", *reasons))
    return "; ".join(reasons)


def no_room(request: PodRequest, *, unit: contract.MemoryUnit) -> str:
    """The filter's reason for a node whose usable GPUs are all too full for the pod (``most_free`` below
    its share). The same words for every such node, on purpose: kube-scheduler counts its nodes' reasons
    into one line ("0/5000 nodes are available: 4200 no usable GPU has 8 GiB free, ..."), where a reason
    that listed each node's GPUs (``explain``, which bind still gives for its one node) would make that
    line one entry per node, hundreds of kilobytes at a few thousand nodes, and cost the extender most of
    a filter's time to write. ``kubectl inspect gpushare`` shows what each GPU has free."""
    if request.gpus > 1:
        return f"fewer than {request.gpus} usable GPUs have {request.per_gpu} {unit.value} free each"
    return f"no usable GPU has {request.per_gpu} {unit.value} free"


@dataclass(frozen=True)
class NodeCpu:
    """A node's CPU as kube-scheduler's NodeResourcesFit counts it, in milli-CPU: what pods may request in
    all, and what the pods bound to it request."""

    allocatable: int
    requested: int


_NO_MIX: Final = RequestMix()


class Setting:
    """What a policy may weigh beside the GPU it prices: the mix of pods seen, the free memory of every
    healthy GPU of the node, and the node's CPU and the pod's (unknown CPU: None).

    Worked out on first use: best fit and spread read none of it, and the extender prices a thousand nodes
    per call.
    """

    def __init__(self, ledger: Ledger, *, mix: RequestMix = _NO_MIX, cpu: NodeCpu | None = None, pod_cpu: int = 0):
        self.ledger = ledger
        self.mix = mix
        self.cpu = cpu
        self.pod_cpu = pod_cpu

    @functools.cached_property
    def _gpus(self) -> tuple[dict[int, int], list[int], int]:
        """(GPU index -> position, free units per position, units in all) of the healthy GPUs."""
        healthy = [gpu for gpu in self.ledger.inventory.gpus if gpu.healthy]
        frees = [max(self.ledger.free(gpu), 0) for gpu in healthy]
        return {gpu.index: i for i, gpu in enumerate(healthy)}, frees, sum(gpu.memory for gpu in healthy)

    @property
    def cpu_free(self) -> int | None:
        return None if self.cpu is None else self.cpu.allocatable - self.cpu.requested

    @functools.cached_property
    def _fragment(self) -> float:
        return self.mix.fragment(self._gpus[1], cpu_free=self.cpu_free)

    def growth(self, verdicts: Sequence[GpuVerdict], need: int) -> float:
        """How much the node's expected fragment (``RequestMix.fragment``) grows when the pod takes ``need``
        units of each of the verdicts' GPUs."""
        position, frees, _ = self._gpus
        after = list(frees)
        for verdict in verdicts:
            after[position[verdict.gpu.index]] -= need
        cpu_free = self.cpu_free
        left = None if cpu_free is None else cpu_free - self.pod_cpu
        return self.mix.fragment(after, cpu_free=left) - self._fragment

    def imbalance(self, need: int) -> float:
        """How far apart the node's shares of CPU and of GPU memory left would be with the pod on it. A node
        that runs out of CPU first strands its GPU memory, and one that runs out of GPU memory its CPU."""
        _, frees, capacity = self._gpus
        cpu_free = self.cpu_free
        if self.cpu is None or cpu_free is None or self.cpu.allocatable <= 0 or capacity <= 0:
            return 0.0
        cpu_left = (cpu_free - self.pod_cpu) / self.cpu.allocatable
        return abs(cpu_left - (sum(frees) - need) / capacity)


#: How a policy ranks a node: its price, then, among nodes priced equal, how unbalanced it would be.
NodeKey = tuple[float, float]


#: The GPUs a pod is put on (as many as ``PodRequest.gpus``), in the order the policy ranked them.
Choice = tuple[GpuVerdict, ...]


@dataclass(frozen=True)
class Policy:
    """Where on a node a pod goes, and how good the node is for it.

    ``cost`` prices putting ``need`` units on one fitting GPU (lower is better) given the node's setting;
    a node costs what its cheapest GPU costs. Equal costs go to the GPU with less free memory, then the
    lower index, so choices are deterministic and, among equals, pack. A pod on several GPUs takes those
    that rank first, and the node costs what they cost together: ``cost_of_several``, or the sum of their
    costs when a policy's prices add up.
    """

    name: str
    cost: Callable[[GpuVerdict, int, Setting], float]
    cost_of_several: Callable[[Choice, int, Setting], float] | None = None
    #: whether ``cost`` reads the mix: prices that do not are kept when a new mix is taken
    reads_mix: bool = False
    #: whether ``cost`` reads the node's and the pod's CPU: prices that do are kept per pod CPU request and
    #: until the node's CPU changes
    reads_cpu: bool = False
    #: whether nodes priced equal are told apart by ``Setting.imbalance``
    balances: bool = False

    def rank(self, verdict: GpuVerdict, need: int, setting: Setting) -> tuple[float, int, int]:
        return (self.cost(verdict, need, setting), verdict.free, verdict.gpu.index)

    def choose(self, verdicts: Sequence[GpuVerdict], request: PodRequest, setting: Setting) -> Choice | None:
        best = self._best(verdicts, request, setting)
        return None if best is None else best[1]

    def appraise(
        self, verdicts: Sequence[GpuVerdict], request: PodRequest, setting: Setting
    ) -> tuple[NodeKey, Choice] | None:
        """How the node ranks for the pod, and the GPUs it would get there; None when too few GPUs fit."""
        best = self._best(verdicts, request, setting)
        if best is None:
            return None
        tiebreak = setting.imbalance(request.total) if self.balances else 0.0
        return (best[0], tiebreak), best[1]

    def _best(
        self, verdicts: Sequence[GpuVerdict], request: PodRequest, setting: Setting
    ) -> tuple[float, Choice] | None:
        """The fitting GPUs that rank first, with their cost (each GPU priced once: fgd's prices are not free)."""
        need, gpus = request.per_gpu, request.gpus
        ranked = [(self.rank(v, need, setting), v) for v in verdicts if v.fits]
        if len(ranked) < gpus:  # gpus >= 1: none fitting is too few
            return None
        if gpus == 1:
            rank, verdict = min(ranked, key=lambda pair: pair[0])
            return rank[0], (verdict,)
        ranked.sort(key=lambda pair: pair[0])
        chosen = tuple(verdict for _, verdict in ranked[:gpus])
        if self.cost_of_several is None:
            return sum(rank[0] for rank, _ in ranked[:gpus]), chosen
        return self.cost_of_several(chosen, need, setting), chosen


def best_key(keys: Iterable[NodeKey | None]) -> NodeKey | None:
    """The best of ``keys``: the lowest price, then among the nodes at that price the least imbalance."""
    known = [k for k in keys if k is not None]
    if not known:
        return None
    cheapest = min(cost for cost, _ in known)
    return cheapest, min(tiebreak for cost, tiebreak in known if cost <= cheapest + EQUAL_COST)


def ties(key: NodeKey, best: NodeKey) -> bool:
    """Whether a node ranked ``key`` is as good as the best (up to float sums): it earns MAX_SCORE."""
    return key[0] <= best[0] + EQUAL_COST and key[1] <= best[1] + EQUAL_COST


def node_scores(keys: Sequence[NodeKey | None]) -> list[int]:
    """Extender scores (0..MAX_SCORE) for nodes ranked ``keys``: the best get MAX_SCORE and nobody else
    does; nodes at the best price but less balanced MAX_SCORE-1; the rest 0..MAX_SCORE-1 by where their
    price lies between the cheapest and the dearest. Relative, because kube-scheduler only compares, and
    an extender has 11 levels: absolute buckets would tie nodes that the policy tells apart. Nodes that
    cannot take the pod get 0."""
    best = best_key(keys)
    if best is None:
        return [0 for _ in keys]
    worst = max(k[0] for k in keys if k is not None)
    scores = []
    for key in keys:
        if key is None:
            scores.append(0)
        elif ties(key, best):
            scores.append(MAX_SCORE)
        elif key[0] <= best[0] + EQUAL_COST:
            scores.append(MAX_SCORE - 1)
        else:
            scores.append(math.floor((MAX_SCORE - 1) * (worst - key[0]) / (worst - best[0]) + EQUAL_COST))
    return scores


#: Costs closer than this are equal (they are sums of float shares).
EQUAL_COST: Final = 1e-9

#: Levels the fgd policy prices in: kube-scheduler's MaxNodeScore, to which the paper's FGD score plugin
#: cuts a sigmoid of the fragment's growth.
FGD_LEVELS: Final = 100


def _fgd_cost(verdict: GpuVerdict, need: int, setting: Setting) -> float:
    return _fgd_levels(setting.growth((verdict,), need) / verdict.gpu.memory)


def _fgd_cost_of_several(verdicts: Choice, need: int, setting: Setting) -> float:
    return _fgd_levels(setting.growth(verdicts, need) / verdicts[0].gpu.memory)


def _fgd_levels(growth: float) -> float:
    """The growth of the node's expected fragment, in GPUs (of the first GPU's size), through a sigmoid cut to
    FGD_LEVELS: growths that close are equal. The mix is an estimate, and telling its hundredths of a GPU
    apart costs more than it wins; among equals the balance of CPU and GPU decides (docs/benchmarks.md)."""
    return -float(math.floor(FGD_LEVELS / (1.0 + math.exp(growth))))


#: Best fit (Aliyun's binpack): the GPU left with the least free memory after placement.
BINPACK: Final = Policy(name="binpack", cost=lambda v, need, setting: float(v.free - need))
#: The GPU left with the most free memory.
SPREAD: Final = Policy(name="spread", cost=lambda v, need, setting: float(need - v.free))
#: Fragmentation gradient descent: the GPU and node where the expected fragment of the node's free GPU
#: memory, for the mix of pods seen and the CPU left, grows least (gpushared.core.fragmentation); among
#: equal growths the node whose CPU and GPU stay most balanced, then best fit. With no mix yet it is best
#: fit among balanced nodes.
FGD: Final = Policy(
    name="fgd",
    cost=_fgd_cost,
    cost_of_several=_fgd_cost_of_several,
    reads_mix=True,
    reads_cpu=True,
    balances=True,
)

POLICIES: Final = {policy.name: policy for policy in (BINPACK, SPREAD, FGD)}


def policy_named(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise contract.ContractError(
            key="policy", value=name, reason=f"unknown placement policy; choose one of {', '.join(POLICIES)}"
        ) from None


def allocation_for(request: PodRequest, gpus: Sequence[GpuInfo], *, unit: contract.MemoryUnit) -> Allocation:
    """Every GPU-using container of ``request`` on the GPUs ``gpus``: a container on one GPU on the first,
    the one container on several GPUs (``PodRequest.gpus``) an even share on each."""
    return Allocation(
        unit=unit,
        containers=tuple(
            ContainerShares(
                name=c.name,
                gpus=tuple(
                    GpuShare(index=gpu.index, uuid=gpu.uuid, amount=c.amount // c.gpus) for gpu in gpus[: c.gpus]
                ),
                init=c.init,
                sidecar=c.sidecar,
            )
            for c in request.containers
        ),
    )


def bind_annotations(
    request: PodRequest,
    gpus: Sequence[GpuInfo],
    *,
    unit: contract.MemoryUnit,
    now_ns: int,
    carried: Collection[str] = (),
) -> dict[str, str]:
    """The pod annotations the extender writes at bind: Aliyun's, for tools and nodes that still read
    them, and our per-container allocation, which the node daemon trusts.

    ``_DEV`` is the chosen GPU's own size (Aliyun writes capacity/count, wrong on mixed nodes) and ``_POD``
    the pod's peak hold on it (Aliyun sums app containers only). Aliyun's GPU annotations name one GPU, so a
    pod on several gets ours only: a reader of ``_IDX`` would count all of it on one GPU. If such a pod
    arrived with them (``carried``: its annotation keys before bind; copied from a running pod, or forged),
    a Binding can only overwrite them, not remove them: ``_IDX`` becomes -1, which Aliyun's tools show as
    not on one GPU.
    """
    annotations = {
        contract.ALIYUN_GPU_MEM_ASSIGNED: contract.format_bool(False),
        contract.ALIYUN_GPU_MEM_ASSUME_TIME: str(now_ns),
        contract.POD_ALLOCATION: contract.format_allocation(allocation_for(request, gpus, unit=unit)),
    }
    if len(gpus) == 1:
        annotations[contract.ALIYUN_GPU_MEM_IDX] = str(gpus[0].index)
        annotations[contract.ALIYUN_GPU_MEM_DEV] = str(gpus[0].memory)
        annotations[contract.ALIYUN_GPU_MEM_POD] = str(request.total)
    else:
        single = {contract.ALIYUN_GPU_MEM_IDX: "-1", contract.ALIYUN_GPU_MEM_DEV: "0"}
        single[contract.ALIYUN_GPU_MEM_POD] = str(request.total)
        annotations.update({key: value for key, value in single.items() if key in carried})
    return annotations


def holding_for(request: PodRequest, gpus: Sequence[GpuInfo], *, uid: str, namespace: str, name: str) -> Holding:
    """What a pod placed on ``gpus`` holds, for recording a bind in the ledger before the watch sees it."""
    return Holding(
        uid=uid, namespace=namespace, name=name, gpus={gpu.index: request.per_gpu for gpu in gpus}, mps=request.mps
    )
