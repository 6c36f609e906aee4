"""Compute shares: a pod's guaranteed and most share of each of its GPUs' SMs, and the MPS thread
percentage that caps an MPS client."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpushared.contract.reading import ContractError, parse_int, require_int
from gpushared.contract.records import ANNOTATION_DOMAIN, POD_MPS_THREAD_PERCENTAGE

#: Pod: the share of each of its GPUs' compute (SMs) the pod is guaranteed, in percent (0-100): scheduled,
#: so the requests on one GPU never sum past 100 (docs/design.md, "Compute shares").
POD_COMPUTE_REQUEST: Final = f"{ANNOTATION_DOMAIN}/gpu-compute-request"
#: Pod: the most of each of its GPUs' compute any of its containers may use, in percent (1-100): the MPS
#: thread percentage of an MPS pod; measured and reported for the others.
POD_COMPUTE_LIMIT: Final = f"{ANNOTATION_DOMAIN}/gpu-compute-limit"


def parse_thread_percentage(text: object) -> int:
    return parse_int(POD_MPS_THREAD_PERCENTAGE, text, minimum=1, maximum=100)


@dataclass(frozen=True)
class ComputeShare:
    """A pod's compute on each of its GPUs, in percent: at least ``request``, at most ``limit``."""

    request: int = 0
    limit: int = 100

    def __post_init__(self) -> None:
        if not 0 <= self.request <= self.limit <= 100 or self.limit < 1:
            raise ContractError(
                key=POD_COMPUTE_REQUEST,
                value={"request": self.request, "limit": self.limit},
                reason="must be 0 <= request <= limit <= 100 and limit >= 1 (percent of one GPU's compute)",
            )


def parse_compute(annotations: Mapping[str, str]) -> ComputeShare | None:
    """The pod's compute share from its annotations; None when it gives neither (compute then unscheduled,
    as before compute shares existed). A request alone is capped at 100, a limit alone guarantees nothing."""
    request_text, limit_text = annotations.get(POD_COMPUTE_REQUEST), annotations.get(POD_COMPUTE_LIMIT)
    if request_text is None and limit_text is None:
        return None
    request = 0 if request_text is None else parse_int(POD_COMPUTE_REQUEST, request_text, maximum=100)
    limit = 100 if limit_text is None else parse_int(POD_COMPUTE_LIMIT, limit_text, minimum=1, maximum=100)
    if request > limit:
        raise ContractError(
            key=POD_COMPUTE_REQUEST,
            value=request_text,
            reason=f"is more than {POD_COMPUTE_LIMIT} ({limit}): a pod cannot be guaranteed more than it may use",
        )
    return ComputeShare(request=request, limit=limit)


def parse_compute_record(key: str, record: object) -> ComputeShare | None:
    """The ``compute`` record of an allocation (None: the pod asked for none), read under ``key``."""
    if record is None:
        return None
    if not isinstance(record, dict):
        raise ContractError(key=key, value=record, reason="'compute' must be an object")
    request = require_int(key, "compute.request", record.get("request", 0))
    limit = require_int(key, "compute.limit", record.get("limit", 100))
    try:
        return ComputeShare(request=request, limit=limit)
    except ContractError as exc:
        raise ContractError(key=key, value=record, reason=f"compute: {exc.reason}") from None
