"""What each container's processes use of a GPU's compute, and who uses more than their pod's limit.

A pod's compute limit (``gpushared.io/gpu-compute-limit``) is a cap the driver enforces only for MPS
clients (their ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). For the others nothing in the driver caps SM use:
the daemon reads each process's SM use from NVML's samples, sums it per container and GPU, and reports a
container above its pod's limit (by more than a tolerance, for sampling noise) once per episode: an
Event on the pod and a counter. It is measured and said, not enforced (docs/mps.md).

Pure: the daemon's compute watcher gathers the samples and owners, and acts on the outcome.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpushared.core.node.memory import ContainerRef

#: Percentage points above its limit a container may be measured at before it is reported: NVML's samples
#: are short windows, and a kernel launched at the edge of one reads high.
TOLERANCE = 5


@dataclass(frozen=True)
class ComputeUse:
    """What one container's processes use of one GPU's SMs, in percent, and its pod's limit (None: the
    pod gave none)."""

    ref: ContainerRef
    gpu: int
    sm_percent: int
    limit: int | None

    @property
    def over(self) -> int:
        """Percentage points above the limit (0 when within it, or without one)."""
        return max(self.sm_percent - self.limit, 0) if self.limit is not None else 0


#: (pod UID, container, GPU index): one container on one GPU
UseKey = tuple[str, str, int]


@dataclass(frozen=True)
class ComputeDecision:
    uses: tuple[ComputeUse, ...] = ()
    #: uses newly above their limit (beyond the tolerance): each reported once per episode
    reports: tuple[ComputeUse, ...] = ()
    #: the keys above their limit now: an episode lasts until its container falls back within it
    over: frozenset[UseKey] = field(default_factory=frozenset)


def decide_compute(
    samples: Iterable[tuple[int, ContainerRef | None, int]],
    limits: Mapping[str, int],
    *,
    over_before: frozenset[UseKey] = frozenset(),
    tolerance: int = TOLERANCE,
) -> ComputeDecision:
    """``samples``: (GPU index, the process's container or None, its SM use %) for each sampled process;
    ``limits``: pod UID -> its compute limit, for the pods that gave one; ``over_before``: the previous
    decision's ``over``."""
    summed: dict[tuple[ContainerRef, int], int] = {}
    for gpu, owner, sm in samples:
        if owner is not None:
            summed[(owner, gpu)] = summed.get((owner, gpu), 0) + sm
    uses = tuple(
        ComputeUse(ref, gpu, min(sm, 100), limits.get(ref.uid))
        for (ref, gpu), sm in sorted(summed.items(), key=lambda item: (str(item[0][0]), item[0][1]))
    )
    over = frozenset((u.ref.uid, u.ref.container, u.gpu) for u in uses if u.over > tolerance)
    reports = tuple(u for u in uses if (u.ref.uid, u.ref.container, u.gpu) in over - over_before)
    return ComputeDecision(uses=uses, reports=reports, over=over)
