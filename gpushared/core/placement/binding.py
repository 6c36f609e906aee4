"""The bind record: what a bind writes on the pod to say where its GPU memory is.

The extender writes it in the Binding's annotations (docs/design.md §3, §6); the daemon, inspect and every
ledger read it back through ``core.shared.ledger.holding_from_pod``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from gpushared import contract
from gpushared.contract import Allocation, ContainerShares, GpuInfo, GpuShare
from gpushared.core.shared.ledger import Holding
from gpushared.core.shared.requests import PodRequest


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
        compute=request.compute,
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
        uid=uid,
        namespace=namespace,
        name=name,
        gpus={gpu.index: request.per_gpu for gpu in gpus},
        mps=request.mps,
        compute=request.compute_request,
    )
