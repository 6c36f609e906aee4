"""Choosing a GPU for a pod, scoring nodes, and the annotations that record the choice.

Every caller goes through :func:`judge`, so the extender's filter reasons, its bind and the trace replay
cannot disagree about what fits. A policy only prices the GPUs that fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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
    unit = ledger.unit.value
    need = request.total
    verdicts = []
    for gpu in ledger.inventory.gpus:
        free = ledger.free(gpu)
        reason = (
            "pod requests no GPU memory"
            if need <= 0
            else _refusal(ledger, gpu, mps=request.mps, max_mps_clients=max_mps_clients)
        )
        if reason is None and free < need:
            reason = f"GPU {gpu.index} has {max(free, 0)} {unit} free, pod needs {need} {unit}"
        verdicts.append(GpuVerdict(gpu=gpu, free=free, reason=reason))
    return verdicts


def fitting(ledger: Ledger, request: PodRequest, *, max_mps_clients: int = MAX_MPS_CLIENTS) -> list[GpuVerdict]:
    """The verdicts of :func:`judge` that fit, without working out why the others do not: what pricing a
    node needs, a thousand nodes at a time (a property test holds the two together)."""
    need = request.total
    if need <= 0:
        return []
    fits = []
    for gpu in ledger.inventory.gpus:
        free = ledger.free(gpu)
        if free >= need and _refusal(ledger, gpu, mps=request.mps, max_mps_clients=max_mps_clients) is None:
            fits.append(GpuVerdict(gpu=gpu, free=free, reason=None))
    return fits


def most_free(ledger: Ledger, *, mps: bool, max_mps_clients: int = MAX_MPS_CLIENTS) -> int:
    """The most units free on one GPU that a pod of this kind (MPS or not) may take; -1 when none may.

    :func:`judge` finds a GPU that fits a request exactly when the request is positive and at most this, so
    a filter can answer from one number per node, kept until the ledger changes, instead of judging every GPU
    of every candidate on every call."""
    usable = (
        ledger.free(gpu)
        for gpu in ledger.inventory.gpus
        if _refusal(ledger, gpu, mps=mps, max_mps_clients=max_mps_clients) is None
    )
    return max(usable, default=-1)


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


def explain(verdicts: list[GpuVerdict]) -> str:
    """One line for a node that cannot take the pod (the extender's FailedNodes entry)."""
    if not verdicts:
        return "node has no GPUs"
    return "; ".join(dict.fromkeys(v.reason for v in verdicts if v.reason))


@dataclass(frozen=True)
class Policy:
    """Where on a node a pod goes, and how good the node is for it.

    ``cost`` prices putting ``need`` units on one fitting GPU (lower is better) given the mix of requests
    seen; a node costs what its cheapest GPU costs. Equal costs go to the GPU with less free memory, then
    the lower index, so choices are deterministic and, among equals, pack.
    """

    name: str
    cost: Callable[[GpuVerdict, int, RequestMix], float]
    #: whether ``cost`` reads the mix: prices that do not are kept when a new mix is taken
    reads_mix: bool = False

    def rank(self, verdict: GpuVerdict, need: int, mix: RequestMix) -> tuple[float, int, int]:
        return (self.cost(verdict, need, mix), verdict.free, verdict.gpu.index)

    def choose(self, verdicts: Sequence[GpuVerdict], request: PodRequest, mix: RequestMix) -> GpuVerdict | None:
        fitting = [v for v in verdicts if v.fits]
        if not fitting:
            return None
        return min(fitting, key=lambda v: self.rank(v, request.total, mix))

    def node_cost(self, verdicts: Sequence[GpuVerdict], request: PodRequest, mix: RequestMix) -> float | None:
        """The cost of the node's best GPU; None when no GPU fits."""
        best = self.choose(verdicts, request, mix)
        return None if best is None else self.cost(best, request.total, mix)


def node_scores(costs: Sequence[float | None]) -> list[int]:
    """Extender scores (0..MAX_SCORE) for nodes with these costs: the cheapest get MAX_SCORE and nobody else
    does, the rest 0..MAX_SCORE-1 by where they lie between the cheapest and the dearest. Relative, because
    kube-scheduler only compares, and an extender has 11 levels: absolute buckets would tie nodes that the
    policy tells apart. Nodes that cannot take the pod get 0."""
    known = [c for c in costs if c is not None]
    if not known:
        return [0 for _ in costs]
    best, worst = min(known), max(known)
    scores = []
    for cost in costs:
        if cost is None:
            scores.append(0)
        elif cost <= best + EQUAL_COST:
            scores.append(MAX_SCORE)
        else:
            scores.append(math.floor((MAX_SCORE - 1) * (worst - cost) / (worst - best) + EQUAL_COST))
    return scores


#: Costs closer than this are equal (they are sums of float shares).
EQUAL_COST: Final = 1e-9

#: Best fit (Aliyun's binpack): the GPU left with the least free memory after placement.
BINPACK: Final = Policy(name="binpack", cost=lambda v, need, mix: float(v.free - need))
#: The GPU left with the most free memory.
SPREAD: Final = Policy(name="spread", cost=lambda v, need, mix: float(need - v.free))
#: Fragmentation gradient descent: the GPU whose expected fragment, for the mix of requests seen, grows
#: least (gpushared.core.fragmentation); best fit among equals. With no mix yet it is best fit.
FGD: Final = Policy(name="fgd", cost=lambda v, need, mix: mix.growth(v.free, need), reads_mix=True)

POLICIES: Final = {policy.name: policy for policy in (BINPACK, SPREAD, FGD)}


def policy_named(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise contract.ContractError(
            key="policy", value=name, reason=f"unknown placement policy; choose one of {', '.join(POLICIES)}"
        ) from None


def allocation_for(request: PodRequest, gpu: GpuInfo, *, unit: contract.MemoryUnit) -> Allocation:
    """Every GPU-using container of ``request`` on the one GPU ``gpu``."""
    return Allocation(
        unit=unit,
        containers=tuple(
            ContainerShares(
                name=c.name,
                gpus=(GpuShare(index=gpu.index, uuid=gpu.uuid, amount=c.amount),),
                init=c.init,
                sidecar=c.sidecar,
            )
            for c in request.containers
        ),
    )


def bind_annotations(request: PodRequest, gpu: GpuInfo, *, unit: contract.MemoryUnit, now_ns: int) -> dict[str, str]:
    """The pod annotations the extender writes at bind: Aliyun's, for tools and nodes that still read
    them, and our per-container allocation, which the node daemon trusts.

    ``_DEV`` is the chosen GPU's own size (Aliyun writes capacity/count, wrong on mixed nodes) and ``_POD``
    the pod's peak hold on it (Aliyun sums app containers only).
    """
    return {
        contract.ALIYUN_GPU_MEM_IDX: str(gpu.index),
        contract.ALIYUN_GPU_MEM_DEV: str(gpu.memory),
        contract.ALIYUN_GPU_MEM_POD: str(request.total),
        contract.ALIYUN_GPU_MEM_ASSIGNED: contract.format_bool(False),
        contract.ALIYUN_GPU_MEM_ASSUME_TIME: str(now_ns),
        contract.POD_ALLOCATION: contract.format_allocation(allocation_for(request, gpu, unit=unit)),
    }


def holding_for(request: PodRequest, gpu: GpuInfo, *, uid: str, namespace: str, name: str) -> Holding:
    """What a pod placed on ``gpu`` holds, for recording a bind in the ledger before the watch sees it."""
    return Holding(uid=uid, namespace=namespace, name=name, gpus={gpu.index: request.total}, mps=request.mps)
