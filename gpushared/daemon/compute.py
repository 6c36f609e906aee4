"""The compute watcher: each poll, NVML's SM samples per process, summed per container, against each pod's
compute limit (core.node.compute decides); over the limit is an Event and a counter, never a kill.

Driven by the memory watcher's poll, which has already listed each GPU's processes and found their
containers: the samples of a PID it did not list (exited since) are not attributed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from gpushared import contract
from gpushared.core.node.compute import ComputeDecision, UseKey, decide_compute
from gpushared.core.node.memory import ContainerRef, GpuProcess
from gpushared.core.shared.bodies import PodBody, annotations_of
from gpushared.core.shared.ledger import recorded_compute
from gpushared.daemon.metrics import ContainerCompute, DaemonMetrics
from gpushared.daemon.outbox import Outbox
from gpushared.nvml.backend import GpuBackend, GpuBackendError

log = logging.getLogger(__name__)

EVENT_COMPUTE_OVER_LIMIT = "GPUComputeOverLimit"


class ComputeWatcher:
    def __init__(self, *, backend: GpuBackend, outbox: Outbox, metrics: DaemonMetrics) -> None:
        self.backend = backend
        self.outbox = outbox
        self.metrics = metrics
        #: GPU UUID -> the newest sample's timestamp (µs) read so far: each poll asks for what is newer
        self._since: dict[str, int] = {}
        self._unreadable: set[str] = set()
        self._over: frozenset[UseKey] = frozenset()
        self.last = ComputeDecision()
        self._uuids: dict[int, str] = {}
        metrics.watch_compute(self.series)

    def observe(self, gpus: Mapping[int, str], processes: Iterable[GpuProcess], pods: Mapping[str, PodBody]) -> None:
        """``gpus``: index -> UUID; ``processes``: what the memory poll listed, with their containers."""
        owners: dict[tuple[int, int], ContainerRef | None] = {(p.gpu, p.pid): p.owner for p in processes}
        samples: list[tuple[int, ContainerRef | None, int]] = []
        for index, uuid in gpus.items():
            for pid, sm in self._sample(index, uuid).items():
                if (index, pid) in owners:
                    samples.append((index, owners[(index, pid)], sm))
        owning = {ref.uid for _, ref, _ in samples if ref is not None}  # each pod's annotations read once
        limits = {uid: limit for uid in owning if (limit := _limit(pods.get(uid))) is not None}
        decision = decide_compute(samples, limits, over_before=self._over)
        self._over, self.last, self._uuids = decision.over, decision, dict(gpus)
        for use in decision.reports:
            self.metrics.compute_overruns.inc()
            message = (
                f"{use.ref} used {use.sm_percent}% of GPU {use.gpu}'s SMs, over its pod's compute limit of "
                f"{use.limit}% ({contract.POD_COMPUTE_LIMIT}); without MPS the limit is measured, not enforced"
            )
            log.warning("%s", message)
            pod = pods.get(use.ref.uid)
            if pod is not None:
                self.outbox.event(pod, EVENT_COMPUTE_OVER_LIMIT, message, warning=True)

    def _sample(self, index: int, uuid: str) -> dict[int, int]:
        try:
            use, self._since[uuid] = self.backend.sm_use(uuid, self._since.get(uuid, 0))
        except GpuBackendError as exc:
            if uuid not in self._unreadable:
                self._unreadable.add(uuid)
                log.warning("GPU %d: its processes' SM use cannot be read (%s); its compute is not watched", index, exc)
            return {}
        self._unreadable.discard(uuid)
        return use

    def series(self) -> list[ContainerCompute]:
        return [
            ContainerCompute(
                namespace=use.ref.namespace,
                pod=use.ref.pod,
                container=use.ref.container,
                gpu=use.gpu,
                uuid=self._uuids.get(use.gpu, ""),
                used=use.sm_percent / 100,
                limit=None if use.limit is None else use.limit / 100,
            )
            for use in self.last.uses
        ]


def _limit(pod: PodBody | None) -> int | None:
    """The pod's compute limit, when it gave a compute share; a share that does not parse has none here
    (the extender refused to place it, and the memory watcher reports bad annotations)."""
    if pod is None:
        return None
    bound = recorded_compute(annotations_of(pod))  # a placed pod's limit is its bind record's, not an edit's
    if bound is not None:
        return bound.limit
    try:
        share = contract.parse_compute(annotations_of(pod))
    except contract.ContractError:
        return None
    return None if share is None else share.limit
