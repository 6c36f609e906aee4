"""Aliyun's pod annotations, kept byte-compatible so that nodes can migrate one at a time: written by the
extender at bind (ASSIGNED flipped by the node daemon), and the closed scheduler's allocation, read only."""

from __future__ import annotations

from typing import Final

from gpushared.contract.reading import ContractError, load_json, parse_int, require_int

ALIYUN_GPU_MEM_IDX: Final = "ALIYUN_COM_GPU_MEM_IDX"
ALIYUN_GPU_MEM_DEV: Final = "ALIYUN_COM_GPU_MEM_DEV"
ALIYUN_GPU_MEM_POD: Final = "ALIYUN_COM_GPU_MEM_POD"
ALIYUN_GPU_MEM_ASSIGNED: Final = "ALIYUN_COM_GPU_MEM_ASSIGNED"
ALIYUN_GPU_MEM_ASSUME_TIME: Final = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
#: Written by Alibaba's closed "gpushare 2.0"; read (never written) so that inspect shows those pods.
ALIYUN_FRAMEWORK_ALLOCATION: Final = "scheduler.framework.gpushare.allocation"


def parse_framework_allocation(text: str) -> dict[int, dict[int, int]]:
    """Alibaba's closed scheduler's ``{"<container index>": {"<gpu index>": amount}}``."""
    key = ALIYUN_FRAMEWORK_ALLOCATION
    body = load_json(key, text)
    if not isinstance(body, dict):
        raise ContractError(key=key, value=text, reason="expected a JSON object")
    result: dict[int, dict[int, int]] = {}
    for container, gpus in body.items():
        if not isinstance(gpus, dict):
            raise ContractError(key=key, value=text, reason=f"container {container}: expected an object")
        result[parse_int(key, container)] = {
            parse_int(key, gpu): require_int(key, f"container {container} gpu {gpu}", amount)
            for gpu, amount in gpus.items()
        }
    return result
