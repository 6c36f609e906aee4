"""Choosing a GPU for a pod, scoring nodes, and the annotations that record the choice.

Every caller goes through :func:`judge`, so the extender's filter reasons, its bind and the trace replay
cannot disagree about what fits. A policy only orders the GPUs that fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gpushared import contract
from gpushared.contract import Allocation, ContainerShares, GpuInfo, GpuShare
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


def judge(ledger: Ledger, request: PodRequest, *, max_mps_clients: int = MAX_MPS_CLIENTS) -> list[GpuVerdict]:
    unit = ledger.unit.value
    need = request.total
    verdicts = []
    for gpu in ledger.inventory.gpus:
        free = ledger.free(gpu)
        mode = ledger.mode(gpu.index)
        reason: str | None = None
        if need <= 0:
            reason = "pod requests no GPU memory"
        elif not gpu.healthy:
            reason = f"GPU {gpu.index} is unhealthy"
        elif request.mps and not gpu.mps_capable:
            reason = f"GPU {gpu.index} runs no MPS server"
        elif request.mps and mode is GpuMode.SHARED:
            reason = f"GPU {gpu.index} is shared by pods without MPS"
        elif not request.mps and mode is GpuMode.MPS:
            reason = f"GPU {gpu.index} serves MPS pods"
        elif request.mps and ledger.mps_clients(gpu.index) >= max_mps_clients:
            reason = f"GPU {gpu.index} has {ledger.mps_clients(gpu.index)} MPS clients, the most it takes"
        elif free < need:
            reason = f"GPU {gpu.index} has {max(free, 0)} {unit} free, pod needs {need} {unit}"
        verdicts.append(GpuVerdict(gpu=gpu, free=free, reason=reason))
    return verdicts


def explain(verdicts: list[GpuVerdict]) -> str:
    """One line for a node that cannot take the pod (the extender's FailedNodes entry)."""
    if not verdicts:
        return "node has no GPUs"
    return "; ".join(dict.fromkeys(v.reason for v in verdicts if v.reason))


@dataclass(frozen=True)
class Policy:
    """Orders the GPUs that fit (``rank``: smaller is better) and scores a node by its best GPU.

    ``score`` turns the best GPU's fill after placement (0.0 empty .. 1.0 full) into 0..MAX_SCORE.
    """

    name: str
    rank: Callable[[GpuVerdict], tuple[int, ...]]
    score: Callable[[float], float]

    def choose(self, verdicts: list[GpuVerdict]) -> GpuVerdict | None:
        fitting = [v for v in verdicts if v.fits]
        return min(fitting, key=self.rank) if fitting else None

    def node_score(self, verdicts: list[GpuVerdict], request: PodRequest) -> int:
        best = self.choose(verdicts)
        if best is None or best.gpu.memory <= 0:
            return 0
        fill_after = (best.gpu.memory - best.free + request.total) / best.gpu.memory
        return max(0, min(MAX_SCORE, math.floor(self.score(fill_after) * MAX_SCORE)))


#: Aliyun's best fit: the healthy GPU with the least free memory that still fits, lowest index on ties.
#: Nodes whose best GPU ends up fullest score highest, so the scheduler packs nodes as well as GPUs.
BINPACK: Final = Policy(name="binpack", rank=lambda v: (v.free, v.gpu.index), score=lambda fill: fill)
#: The GPU with the most free memory, lowest index on ties; emptier nodes score highest.
SPREAD: Final = Policy(name="spread", rank=lambda v: (-v.free, v.gpu.index), score=lambda fill: 1.0 - fill)

POLICIES: Final = {policy.name: policy for policy in (BINPACK, SPREAD)}


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
