"""Node n1's GPUs and pods placed on them by the extender: what Allocate's tables start from."""

from __future__ import annotations

from typing import Any

from gpushared import contract
from gpushared.contract import GpuInventory
from gpushared.core.node.allocate import MpsDaemon
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from tests.builders import inventory, on_gpus, pod

INV = inventory(16, 16, 8)


MPS_INV = inventory(16, 16, 8, mps=True)


BIG = inventory(64, mps=True)  # room for more MPS clients than a server takes


UUID = [gpu.uuid for gpu in INV.gpus]


MPS_DIRS = {uuid: MpsDaemon(pipe=f"/run/mps/{uuid}/pipe", shm=f"/run/mps/{uuid}/shm") for uuid in UUID}


def ids(gpu: int, count: int, start: int = 0) -> list[str]:
    """``count`` of the kubelet's device IDs on GPU ``gpu``."""
    return [f"{gpu}-{j}" for j in range(start, start + count)]


def placed(
    name: str,
    *amounts: int,
    gpus: tuple[int, ...] = (0,),
    at: int = 1,
    mps: bool = False,
    assigned: bool = False,
    inv: GpuInventory = INV,
    **extra: Any,
) -> dict[str, Any]:
    """A pod bound to n1 and placed by the extender on ``gpus`` (one container on all of them when several)."""
    body = pod(name, *amounts, node="n1", annotations={contract.POD_MPS: "true"} if mps else {}, **extra)
    if len(gpus) > 1:
        on_gpus(body, len(gpus))
    annotations = bind_annotations(pod_request(body), [inv.gpus[i] for i in gpus], unit=inv.unit, now_ns=at)
    body["metadata"]["annotations"].update(annotations)
    if assigned:
        body["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_ASSIGNED] = "true"
        body["status"]["phase"] = "Running"
    return body
