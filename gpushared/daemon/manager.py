"""The resource manager: owns the node's GPUs, their health, the devices kubelet sees, and Allocate.

The gRPC server asks it for devices and allocations (it implements ``DeviceManager``); the service loop
feeds it GPU readings and tells it to publish the inventory. Allocate is three steps: ``Candidates``
gathers the pods the call may be for and the handshake names the container (``core.node.handshake``);
``core.node.allocate.decide`` checks the node can give it its GPU and says what it gets; this class acts on the
outcome: answers, records what it served (``Accounting``, the node's books), and leaves the API writes
(the ASSIGNED flag, Events) to the ``Outbox``, so an Allocate answer never waits for the API server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit, ResourceNames
from gpushared.core.node import handshake
from gpushared.core.node.allocate import ContainerAllocation, NodeFacts, Refusal, decide, preferred_devices
from gpushared.core.node.devices import Device, device_list
from gpushared.core.node.exposure import ExposurePolicy
from gpushared.core.shared.bodies import PodBody, meta_of, uid_of
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.topology import Link, Topology, link_words, topology_of
from gpushared.daemon.accounting import Accounting, Served
from gpushared.daemon.candidates import ALLOCATE_BUDGET_SECONDS, Candidates
from gpushared.daemon.devfiles import CharLinks, present_devices
from gpushared.daemon.health import Health
from gpushared.daemon.metrics import DaemonMetrics, PodShare
from gpushared.daemon.mps import MpsSupervisor
from gpushared.daemon.outbox import Outbox
from gpushared.kube.api import Api
from gpushared.kube.podwatch import PodWatch
from gpushared.kubelet.deviceplugin.server import AllocationRefused
from gpushared.nvml.backend import GpuDevice

log = logging.getLogger(__name__)

EVENT_FAILED = "GPUAllocationFailed"
EVENT_ALLOCATED = "GPUAllocated"
ENVVAR_ONLY = ExposurePolicy()


def inventory_of(
    gpus: Sequence[GpuDevice],
    *,
    unit: MemoryUnit,
    health: Health,
    mps: bool = False,
    links: Mapping[frozenset[int], Link] | None = None,
) -> GpuInventory:
    """What the node publishes of its GPUs. Links go out only when the driver said something of one pair at
    least: a row of ``?`` tells a reader nothing an absent key does not."""
    topology = Topology(links=dict(links or {}))
    return GpuInventory(
        unit=unit,
        gpus=tuple(
            GpuInfo(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                memory=unit.from_mib(g.memory_mib),
                memory_mib=g.memory_mib,
                healthy=health.problem(g.uuid) is None,
                mps_capable=mps,
                numa=g.numa,
            )
            for g in gpus
        ),
        links=link_words(topology, [g.index for g in gpus]) if topology.known else (),
    )


class Manager:
    def __init__(
        self,
        *,
        node: str,
        resources: ResourceNames,
        unit: MemoryUnit,
        api: Api | None,
        pods: PodWatch | None,
        pod_resources_socket: Path,
        health: Health,
        metrics: DaemonMetrics,
        mps: MpsSupervisor | None = None,
        exposure: ExposurePolicy = ENVVAR_ONLY,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.node = node
        self.resources = resources
        self.resource_name = resources.gpu_mem
        self.unit = unit
        self.pods = pods
        self.health = health
        self.metrics = metrics
        self.mps = mps
        self.exposure = exposure
        self.candidates = Candidates(
            node=node, unit=unit, resources=resources, api=api, pods=pods, pod_resources_socket=pod_resources_socket
        )
        self.outbox = Outbox(api, pods, clock=clock)
        self.accounting = Accounting(unit=unit, resources=resources, pods=pods, metrics=metrics, outbox=self.outbox)
        self.served = self.accounting.served  # pod UID -> what we gave it
        self._lock = threading.Condition()
        self._gpus: list[GpuDevice] = []
        self._links: dict[frozenset[int], Link] = {}
        self._reading: tuple[tuple[GpuDevice, ...], tuple[str | None, ...]] = ((), ())
        self._inventory = GpuInventory(unit=unit, gpus=())
        self._version = 0
        self._devices: list[Device] = []
        self._allocate_lock = threading.Lock()
        self.char_links = CharLinks()

    # --- inventory and devices -----------------------------------------------------------------------------

    @property
    def inventory(self) -> GpuInventory:
        with self._lock:
            return self._inventory

    def refresh(self, gpus: Sequence[GpuDevice], links: Mapping[frozenset[int], Link] | None = None) -> bool:
        """Take a GPU reading (or re-read health); True when what kubelet or the cluster sees changed.
        ``links`` None: as the last reading had them."""
        links = self._links if links is None else dict(links)
        # Every half second at idle: the same GPUs in the same health are answered before any inventory is built.
        reading = (tuple(gpus), tuple(self.health.problem(g.uuid) for g in gpus))
        with self._lock:
            if reading == self._reading and links == self._links:
                return False
        inventory = inventory_of(gpus, unit=self.unit, health=self.health, mps=self.mps is not None, links=links)
        with self._lock:
            self._reading = reading
            if inventory == self._inventory:
                self._links = links
                return False
            self._gpus = list(gpus)
            self._links = links
            self._inventory = inventory
            self._devices = device_list(inventory, {g.index: g.healthy for g in inventory.gpus})
            self._version += 1
            self._lock.notify_all()
        for gpu in inventory.gpus:
            self.metrics.gpu_total.labels(**self.metrics.gpu_labels(gpu)).set(MemoryUnit.MIB.to_bytes(gpu.memory_mib))
            self.metrics.gpu_healthy.labels(**self.metrics.gpu_labels(gpu)).set(1 if gpu.healthy else 0)
        return True

    def recheck_health(self) -> bool:
        with self._lock:
            gpus = list(self._gpus)
        return self.refresh(gpus)

    def devices(self) -> tuple[int, list[Device]]:
        with self._lock:
            return self._version, list(self._devices)

    def wait_for_change(self, version: int, timeout: float) -> None:
        """Return when the device list is no longer at ``version``, when :meth:`wake` is called, or after
        ``timeout``; the caller looks again either way."""
        with self._lock:
            if self._version == version:
                self._lock.wait(timeout)

    def wake(self) -> None:
        """Wake every stream waiting in :meth:`wait_for_change`: one of them ended, or the server stops."""
        with self._lock:
            self._lock.notify_all()

    def ledger_key(self) -> tuple[object, ...]:
        """What :meth:`ledger` is built from, cheap to compare (``Accounting.key``)."""
        return self.accounting.key(self.inventory)

    def ledger(self) -> Ledger:
        """This node's books from the pods the watch has seen (``Accounting``)."""
        return self.accounting.ledger(self.inventory)

    def pod_shares(self) -> list[PodShare]:
        return self.accounting.shares(self.inventory)

    # --- the handshake ----------------------------------------------------------------------------------------

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Devices on the GPU the admitted pod's annotations name; empty when the pod cannot be named."""
        try:
            decision = self.candidates.identify(size, served=self._served, deadline=_deadline())
        except (handshake.Unidentified, AllocationRefused) as exc:
            log.info("GetPreferredAllocation for %d: no preference (%s)", size, exc)
            return []
        slot = decision.chosen.next
        assert slot is not None
        return preferred_devices(slot, available, must_include)

    def allocate(self, devices: Sequence[str]) -> ContainerAllocation:
        started = time.perf_counter()
        deadline = _deadline()  # from the call, waiting for the lock included
        try:
            with self._allocate_lock:
                result = self._allocate(devices, deadline=deadline)
        except AllocationRefused as exc:
            self.metrics.allocate_failures.inc()
            log.warning("Allocate %d devices refused: %s", len(devices), exc.message)
            raise
        finally:
            self.metrics.allocate_seconds.observe(time.perf_counter() - started)
        return result

    def _allocate(self, devices: Sequence[str], *, deadline: float) -> ContainerAllocation:
        try:
            decision = self.candidates.identify(len(devices), served=self._served, deadline=deadline)
        except handshake.Unidentified as exc:
            self._refuse(Refusal(exc.message, exc.pod))
        chosen = decision.chosen
        slot = chosen.next
        assert slot is not None
        outcome = decide(chosen, devices, self.facts())
        if isinstance(outcome, Refusal):
            self._refuse(outcome)
        self.char_links.ensure(outcome.devices)
        if decision.ambiguous_but_equivalent:
            log.info(
                "Allocate: %s and %s wait for the same %d %s on %s; either is right",
                chosen.key,
                ", ".join(decision.ambiguous_but_equivalent),
                slot.amount,
                self.unit.value,
                slot.where,
            )
        self._record(chosen.pod, slot, chosen.slots or [])
        log.info(
            "Allocate: pod %s container %r gets %d %s on %s (%s)",
            chosen.key,
            slot.container,
            slot.amount,
            self.unit.value,
            slot.where,
            ", ".join(gpu.uuid for index in slot.indices if (gpu := self.inventory.by_index(index))),
        )
        return outcome

    def facts(self) -> NodeFacts:
        """What decide() needs to know about the node now; the device files are looked at only when the
        node's policy passes them."""
        with self._lock:  # the inventory and its GPUs' minors from one reading
            gpus, inventory = list(self._gpus), self._inventory
        present = present_devices(self.exposure, (g.minor for g in gpus)) if self.exposure.device_nodes else []
        return NodeFacts(
            name=self.node,
            inventory=inventory,
            ledger=self.ledger(),
            exposure=self.exposure,
            minors={g.uuid: g.minor for g in gpus},
            present_devices=present,
            mps=self.mps.answering() if self.mps is not None else None,
        )

    def _served(self, uid: str) -> Collection[str]:
        served = self.served.get(uid)
        return served.containers.keys() if served is not None else ()

    def _refuse(self, refusal: Refusal) -> NoReturn:
        if refusal.pod is not None:
            self.outbox.event(refusal.pod, EVENT_FAILED, refusal.message, warning=True)
        raise AllocationRefused(refusal.message)

    def _record(self, pod: PodBody, slot: handshake.Slot, slots: Sequence[handshake.Slot]) -> None:
        meta = meta_of(pod)
        uid = uid_of(pod)
        served = self.served.setdefault(uid, Served(namespace=meta.get("namespace", ""), name=meta.get("name", "")))
        served.containers[slot.container] = slot
        self.metrics.allocations.inc()
        if all(s.container in served.containers for s in slots) and not served.assigned:
            served.assigned = True
            placed = ", ".join(f"{c} on {given.where}" for c, given in served.containers.items())
            self.outbox.mark_assigned(pod)
            self.outbox.event(pod, EVENT_ALLOCATED, f"GPU memory allocated: {placed}", warning=False)

    def forget_departed(self) -> None:
        """Drop what we served to pods that are gone, so a long-lived daemon's memory stays flat."""
        if self.pods is None or not self.pods.synced:
            return
        present = {uid_of(p) for p in self.pods.pods()}
        with self._allocate_lock:
            self.accounting.forget(present)
            self.candidates.forget(present)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued API writes are done (tests, shutdown)."""
        return self.outbox.flush(timeout)

    # --- status ------------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        inventory = self.inventory
        ledger = self.ledger()
        topology = topology_of(inventory)
        return {
            "node": self.node,
            "resource": self.resource_name,
            "unit": self.unit.value,
            "gpus": [
                {
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "model": gpu.model,
                    "memory": gpu.memory,
                    "used": ledger.used(gpu.index),
                    "healthy": gpu.healthy,
                    "problem": self.health.problem(gpu.uuid),
                    "numa": gpu.numa,
                }
                for gpu in inventory.gpus
            ],
            # the link matrix, as nvidia-smi topo -m prints it; empty when the driver says nothing of links
            "links": topology.matrix([gpu.index for gpu in inventory.gpus]) if topology.known else [],
            "pods": [
                {
                    "namespace": h.namespace,
                    "name": h.name,
                    "gpus": {str(k): v for k, v in sorted(h.gpus.items())},
                    "pending": h.pending,
                    "assigned": h.assigned,
                    "containers": {c: slot.indices for c, slot in self.served[h.uid].containers.items()}
                    if h.uid in self.served
                    else {},
                    "problem": h.problem,
                }
                for h in sorted(ledger.holdings(), key=lambda h: (h.namespace, h.name))
            ],
        }


def _deadline() -> float:
    return time.monotonic() + ALLOCATE_BUDGET_SECONDS
