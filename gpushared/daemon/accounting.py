"""This node's books: the ledger of what each pod holds on which GPU, from the pods the watch has seen.

A pod's holding is read from its annotations (``holding_from_pod``), except where this daemon already gave
its containers GPUs and the annotations were edited since to name others: the containers run where the
kubelet put them, so they are counted there, and the edit is reported once (an Event and a metric).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from gpushared.contract import GpuInventory, MemoryUnit, ResourceNames
from gpushared.core.node import handshake
from gpushared.core.shared.bodies import PodBody, meta_of, uid_of
from gpushared.core.shared.ledger import Holding, Ledger, holding_from_pod
from gpushared.daemon.metrics import DaemonMetrics, PodShare
from gpushared.daemon.outbox import Outbox
from gpushared.kube.podwatch import PodWatch

log = logging.getLogger(__name__)

EVENT_EDITED = "GPUAllocationEdited"
EVENT_UNREADABLE = "GPUAnnotationUnreadable"


@dataclass
class Served:
    """What this daemon answered Allocate with, per pod, for status and for finishing the pod."""

    namespace: str
    name: str
    containers: dict[str, handshake.Slot] = field(default_factory=dict)  # container -> where it was put
    assigned: bool = False


class Accounting:
    def __init__(
        self,
        *,
        unit: MemoryUnit,
        resources: ResourceNames,
        pods: PodWatch | None,
        metrics: DaemonMetrics,
        outbox: Outbox,
    ) -> None:
        self.unit = unit
        self.resources = resources
        self.pods = pods
        self.metrics = metrics
        self.outbox = outbox
        self.served: dict[str, Served] = {}  # pod UID -> what Allocate gave it
        self._holdings: dict[str, tuple[str, Holding | None]] = {}  # pod UID -> (resourceVersion, holding)
        self._edited: set[str] = set()  # UIDs of pods whose GPU annotations were edited after Allocate
        self._unreadable: dict[str, str] = {}  # pod UID -> why its annotations cannot be read, as reported

    def key(self, inventory: GpuInventory) -> tuple[object, ...]:
        """What :meth:`ledger` is built from, cheap to compare: the inventory and the pods' mirror (its count
        of changes). What Allocate served is not in it: whoever caches by this key refreshes now and then."""
        return inventory, self.pods.changes if self.pods is not None else 0

    def ledger(self, inventory: GpuInventory) -> Ledger:
        ledger = Ledger.build(inventory)
        for pod in self.pods.pods() if self.pods is not None else []:
            holding = self._holding(pod)
            if holding is not None:
                ledger.add(holding)
        return ledger

    def shares(self, inventory: GpuInventory) -> list[PodShare]:
        """The per-pod series: what each pod holds on each GPU, in bytes."""
        shares = []
        for holding in self.ledger(inventory).holdings():
            for index, amount in sorted(holding.gpus.items()):
                gpu = inventory.by_index(index)
                if gpu is not None:
                    shares.append(
                        PodShare(holding.namespace, holding.name, index, gpu.uuid, self.unit.to_bytes(amount))
                    )
        return shares

    def forget(self, present: set[str]) -> None:
        """Drop what is known of pods that are gone (``present``: the UIDs still there)."""
        for uid in [uid for uid in self.served if uid not in present]:
            del self.served[uid]
        self._edited &= present
        for uid in [uid for uid in self._unreadable if uid not in present]:
            del self._unreadable[uid]
        for uid in [uid for uid in self._holdings if uid not in present]:
            del self._holdings[uid]

    def _holding(self, pod: PodBody) -> Holding | None:
        """holding_from_pod, remembered per pod version: Allocate reads every pod of the node."""
        uid, version = uid_of(pod), meta_of(pod).get("resourceVersion", "")
        cached = self._holdings.get(uid)
        if cached is not None and cached[0] == version:
            return cached[1]
        holding = holding_from_pod(pod, unit=self.unit, resources=self.resources)
        if holding is not None and holding.problem is not None:
            self._report_unreadable(pod, holding)
        holding = self._as_served(pod, holding)
        self._holdings[uid] = (version, holding)
        return holding

    def _as_served(self, pod: PodBody, holding: Holding | None) -> Holding | None:
        """The holding on the GPUs this daemon gave the pod's containers, when its annotations were edited
        since to name others. Reported once per pod, as an Event and a metric."""
        uid = uid_of(pod)
        served = self.served.get(uid)
        if holding is None or served is None or not served.containers:
            return holding
        given: dict[int, int] = {}
        for slot in served.containers.values():
            for index in slot.indices:
                given[index] = max(given.get(index, 0), slot.share)
        if set(given) == set(holding.gpus):
            return holding
        if uid not in self._edited:
            self._edited.add(uid)
            self.metrics.allocation_edits.inc()
            message = (
                f"the GPU annotations of pod {served.namespace}/{served.name} were edited after its containers got "
                f"GPUs {sorted(given)}; they now name {sorted(holding.gpus) or 'none'}. gpushared keeps counting "
                "the GPUs the kubelet gave; delete the pod to move it"
            )
            log.warning("%s", message)
            self.outbox.event(pod, EVENT_EDITED, message, warning=True)
        return dataclasses.replace(holding, gpus=given, pending=0)

    def _report_unreadable(self, pod: PodBody, holding: Holding) -> None:
        """A pod whose GPU annotations or request cannot be read is counted at what its spec asks, on no
        GPU (``holding_from_pod``); its owner hears why once per reason, however often the pod is edited."""
        uid = uid_of(pod)
        if self._unreadable.get(uid) == holding.problem:
            return
        self._unreadable[uid] = holding.problem or ""
        self.metrics.unreadable_pods.inc()
        unit = self.unit.value
        if holding.gpus:
            counted = ", ".join(f"{amount} {unit} on GPU {index}" for index, amount in sorted(holding.gpus.items()))
        elif holding.pending:
            counted = f"{holding.pending} {unit} against the node, on no GPU"
        else:
            counted = "nothing: its spec asks for no GPU memory"
        message = (
            f"the GPU annotations of pod {holding.namespace}/{holding.name} cannot be read ({holding.problem}); "
            f"gpushared counts it at what its spec asks: {counted}"
        )
        log.warning("%s", message[:1000])
        self.outbox.event(pod, EVENT_UNREADABLE, message[:1000], warning=True)
