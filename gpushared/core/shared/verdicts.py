"""Whether a node's GPUs can take a pod, and why not: the one judgement every caller shares.

Every caller goes through :func:`judge` (or a function a property test holds to it: :func:`fitting`,
:func:`most_free`), so the extender's filter reasons, its bind and the trace replay cannot disagree about
what fits. A policy (``core.placement.policies``) only prices the GPUs that fit.
"""

from __future__ import annotations

from typing import Final

from gpushared import contract
from gpushared.contract import GpuInfo
from gpushared.core.shared.ledger import GpuMode, GpuVerdict, Ledger
from gpushared.core.shared.requests import PodRequest

#: Clients one MPS server takes on SM 7.0+ (16 before Volta). Each CUDA process is one client.
MAX_MPS_CLIENTS: Final = 48


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
    """Whether each GPU of the node has room for the pod's share of it (``PodRequest.per_gpu``), and of
    its compute for the pod's compute request, if it makes one."""
    unit = ledger.unit.value
    need, compute = request.per_gpu, request.compute_request
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
        if reason is None and compute and ledger.compute_free(gpu.index) < compute:
            left = max(ledger.compute_free(gpu.index), 0)
            # "percent", not "%": kube-scheduler passes an extender's reason through Sprintf as a format string
            reason = (
                f"GPU {gpu.index} has {left} percent of its compute unrequested, pod requests {compute} percent{each}"
            )
        verdicts.append(GpuVerdict(gpu=gpu, free=free, reason=reason))
    return verdicts


def fitting(ledger: Ledger, request: PodRequest, *, max_mps_clients: int = MAX_MPS_CLIENTS) -> list[GpuVerdict]:
    """The verdicts of :func:`judge` that fit, without working out why the others do not: what pricing a
    node needs, a thousand nodes at a time (a property test holds the two together)."""
    need, compute = request.per_gpu, request.compute_request
    if need <= 0:
        return []
    fits = usable(ledger, mps=request.mps, max_mps_clients=max_mps_clients)
    if compute:
        return [v for v in fits if v.free >= need and ledger.compute_free(v.gpu.index) >= compute]
    return [v for v in fits if v.free >= need]


def usable(ledger: Ledger, *, mps: bool, max_mps_clients: int = MAX_MPS_CLIENTS) -> tuple[GpuVerdict, ...]:
    """A fitting verdict for every GPU a pod of this kind (MPS or not) may use, with its free units; kept on
    the ledger until it changes. Pricing a node for a pod size it has not been priced for is the cold path of
    prioritize, and building these verdicts was half of it (docs/benchmarks.md)."""
    views, key = ledger.views(), (mps, max_mps_clients)
    known = views.usable.get(key)
    if known is not None:
        return known
    verdicts = tuple(
        GpuVerdict(gpu=gpu, free=ledger.free(gpu), reason=None)
        for gpu in ledger.inventory.gpus
        if _refusal(ledger, gpu, mps=mps, max_mps_clients=max_mps_clients) is None
    )
    views.usable[key] = verdicts
    return verdicts


def by_free(
    ledger: Ledger, *, mps: bool, max_mps_clients: int = MAX_MPS_CLIENTS
) -> tuple[list[int], tuple[GpuVerdict, ...]]:
    """The verdicts of :func:`usable` in order of free units, then of index, and their free units alone in
    the same order, to search with ``bisect``; kept on the ledger until it changes. A policy that takes the
    tightest or the emptiest GPU with room finds it with one search (``Policy.appraise``) instead of
    looking at every GPU."""
    views, key = ledger.views(), (mps, max_mps_clients)
    known = views.by_free.get(key)
    if known is not None:
        return known
    ordered = tuple(
        sorted(usable(ledger, mps=mps, max_mps_clients=max_mps_clients), key=lambda v: (v.free, v.gpu.index))
    )
    found = views.by_free[key] = ([v.free for v in ordered], ordered)
    return found


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
    line one entry per node (what that costs: docs/benchmarks.md, "Figures behind the code"). ``kubectl
    inspect gpushare`` shows what each GPU has free."""
    if request.gpus > 1:
        return f"fewer than {request.gpus} usable GPUs have {request.per_gpu} {unit.value} free each"
    return f"no usable GPU has {request.per_gpu} {unit.value} free"
