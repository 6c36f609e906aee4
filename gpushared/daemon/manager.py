"""The resource manager: owns the node's GPUs, their health, the devices kubelet sees, and Allocate.

The gRPC server asks it for devices and allocations (it implements ``DeviceManager``); the service loop
feeds it GPU readings and tells it to publish the inventory. Everything it writes to the API server on
the Allocate path (the ASSIGNED flag, Events) goes through a background queue, so an Allocate answer never
waits for the API server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gpushared import contract
from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit, ResourceNames
from gpushared.core.exposure import CONTROL_DEVICES, CannotExpose, ExposedGpu, Exposure, ExposurePolicy, exposure
from gpushared.core.ledger import Holding, Ledger, holding_from_pod
from gpushared.core.placement import MAX_MPS_CLIENTS
from gpushared.core.requests import pod_request
from gpushared.daemon import devices as device_ids
from gpushared.daemon import handshake
from gpushared.daemon.health import Health
from gpushared.daemon.metrics import Metrics, PodShare
from gpushared.daemon.mps import MpsSupervisor, thread_percentage
from gpushared.deviceplugin.podresources.client import PodDevices, list_pod_devices
from gpushared.deviceplugin.server import AllocationRefused, ContainerAllocation, Mount
from gpushared.kube.api import Api, KubeError
from gpushared.kube.podwatch import PodWatch
from gpushared.nvml.backend import GpuDevice

log = logging.getLogger(__name__)

COMPONENT = "gpushared"
EVENT_FAILED = "GPUAllocationFailed"
EVENT_ALLOCATED = "GPUAllocated"
EVENT_EDITED = "GPUAllocationEdited"
#: What one GetPreferredAllocation or Allocate may spend on the API server, all reads together. The kubelet
#: admits pods one at a time: a hung API server once held every admission on the node for 40 s (10 s x
#: urllib3's retries). Past it the kubelet gets UNAVAILABLE, and tries the pod again.
ALLOCATE_BUDGET_SECONDS = 2.0
ENVVAR_ONLY = ExposurePolicy()


def inventory_of(gpus: Sequence[GpuDevice], *, unit: MemoryUnit, health: Health, mps: bool = False) -> GpuInventory:
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
            )
            for g in gpus
        ),
    )


@dataclass
class Served:
    """What this daemon answered Allocate with, per pod, for status and for finishing the pod."""

    namespace: str
    name: str
    containers: dict[str, handshake.Slot] = field(default_factory=dict)  # container -> where it was put
    assigned: bool = False


class Manager:
    def __init__(
        self,
        *,
        node: str,
        resources: ResourceNames,
        unit: MemoryUnit,
        api: Api | None,
        pods: PodWatch | None,
        pod_resources_socket: Any,
        health: Health,
        metrics: Metrics,
        mps: MpsSupervisor | None = None,
        exposure: ExposurePolicy = ENVVAR_ONLY,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.node = node
        self.resources = resources
        self.resource_name = resources.gpu_mem
        self.unit = unit
        self.api = api
        #: the reads on the kubelet's path: tried once, within what is left of ALLOCATE_BUDGET_SECONDS
        self._lookup = api.without_retries() if api is not None else None
        self.pods = pods
        self.pod_resources_socket = pod_resources_socket
        self.health = health
        self.metrics = metrics
        self.mps = mps
        self.exposure = exposure
        self.clock = clock
        self._lock = threading.Condition()
        self._gpus: list[GpuDevice] = []
        self._inventory = GpuInventory(unit=unit, gpus=())
        self._version = 0
        self._devices: list[tuple[str, bool]] = []
        self._allocate_lock = threading.Lock()
        self.served: dict[str, Served] = {}  # pod UID -> what we gave it
        self._holdings: dict[str, tuple[str, Holding | None]] = {}  # pod UID -> (resourceVersion, holding)
        self._gpu_free: set[str] = set()  # UIDs of pods that ask for no GPU memory
        self._edited: set[str] = set()  # UIDs of pods whose GPU annotations were edited after Allocate
        self._outbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="api-writes", daemon=True)
        self._writer.start()

    # --- inventory and devices -----------------------------------------------------------------------------

    @property
    def inventory(self) -> GpuInventory:
        with self._lock:
            return self._inventory

    def refresh(self, gpus: Sequence[GpuDevice]) -> bool:
        """Take a GPU reading (or re-read health); True when what kubelet or the cluster sees changed."""
        inventory = inventory_of(gpus, unit=self.unit, health=self.health, mps=self.mps is not None)
        with self._lock:
            if inventory == self._inventory:
                return False
            self._gpus = list(gpus)
            self._inventory = inventory
            self._devices = device_ids.device_list(inventory, {g.index: g.healthy for g in inventory.gpus})
            self._version += 1
            self._lock.notify_all()
        for gpu in inventory.gpus:
            self.metrics.gpu_total.labels(gpu=str(gpu.index), uuid=gpu.uuid).set(
                MemoryUnit.MIB.to_bytes(gpu.memory_mib)
            )
            self.metrics.gpu_healthy.labels(gpu=str(gpu.index), uuid=gpu.uuid).set(1 if gpu.healthy else 0)
        return True

    def recheck_health(self) -> bool:
        with self._lock:
            gpus = list(self._gpus)
        return self.refresh(gpus)

    def devices(self) -> tuple[int, list[tuple[str, bool]]]:
        with self._lock:
            return self._version, list(self._devices)

    def wait_for_change(self, version: int, timeout: float) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._version != version, timeout)

    def ledger(self) -> Ledger:
        """This node's accounting from the pods the watch has seen."""
        ledger = Ledger.build(self.inventory)
        for pod in self.pods.pods() if self.pods is not None else []:
            holding = self._holding(pod)
            if holding is not None:
                ledger.add(holding)
        return ledger

    def pod_shares(self) -> list[PodShare]:
        """The per-pod series: what each pod holds on each GPU, in bytes."""
        inventory = self.inventory
        shares = []
        for holding in self.ledger().holdings():
            for index, amount in sorted(holding.gpus.items()):
                gpu = inventory.by_index(index)
                if gpu is not None:
                    shares.append(
                        PodShare(holding.namespace, holding.name, index, gpu.uuid, self.unit.to_bytes(amount))
                    )
        return shares

    def _holding(self, pod: dict[str, Any]) -> Holding | None:
        """holding_from_pod, remembered per pod version: Allocate reads every pod of the node."""
        meta = pod.get("metadata") or {}
        key = (meta.get("uid", ""), meta.get("resourceVersion", ""))
        cached = self._holdings.get(key[0])
        if cached is not None and cached[0] == key[1]:
            return cached[1]
        holding = holding_from_pod(pod, unit=self.unit, resources=self.resources)  # type: ignore[arg-type]
        holding = self._as_served(pod, holding)
        self._holdings[key[0]] = (key[1], holding)
        return holding

    def _as_served(self, pod: dict[str, Any], holding: Holding | None) -> Holding | None:
        """The holding on the GPUs this daemon gave the pod's containers, when its annotations were edited
        since to name others: the containers run where the kubelet put them, whatever the annotations say
        now. Reported once per pod, as an Event and a metric."""
        uid = (pod.get("metadata") or {}).get("uid", "")
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
            self._later(lambda: self._event(pod, EVENT_EDITED, message, warning=True))
        return dataclasses.replace(holding, gpus=given, pending=0)

    # --- the handshake ----------------------------------------------------------------------------------------

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Devices on the GPU the admitted pod's annotations name; empty when the pod cannot be named."""
        try:
            slot = self._identify(size, deadline=time.monotonic() + ALLOCATE_BUDGET_SECONDS).chosen.next
        except (handshake.Unidentified, AllocationRefused) as exc:
            log.info("GetPreferredAllocation for %d: no preference (%s)", size, exc)
            return []
        assert slot is not None
        ordered = sorted(available, key=_natural)
        chosen: list[str] = []
        for index in slot.indices:  # the container's share of each of its GPUs
            on_gpu = [d for d in must_include if device_ids.gpu_of(d) == index]
            on_gpu += [d for d in ordered if device_ids.gpu_of(d) == index and d not in on_gpu]
            if len(on_gpu) < slot.share:
                return []
            chosen += on_gpu[: slot.share]
        return chosen

    def allocate(self, devices: Sequence[str]) -> ContainerAllocation:
        started = time.perf_counter()
        deadline = time.monotonic() + ALLOCATE_BUDGET_SECONDS  # from the call, waiting for the lock included
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
        inventory = self.inventory
        unit = self.unit.value
        decision = self._identify(len(devices), deadline=deadline)
        chosen = decision.chosen
        slot = chosen.next
        assert slot is not None
        pod = chosen.pod
        gpus = [self._placed_gpu(inventory, pod, chosen.key, index, uuid) for index, uuid in slot.gpus]
        ledger = self.ledger()
        held = ledger.holding((pod.get("metadata") or {}).get("uid", "")) is not None
        for gpu in gpus:
            used = ledger.used(gpu.index) + (0 if held else slot.share)
            if used > gpu.memory:
                self._refuse(
                    pod,
                    f"pod {chosen.key} would bring GPU {gpu.index} to {used} {unit} of {gpu.memory} {unit}: "
                    "it does not fit; was it scheduled by another scheduler?",
                )
        # The kubelet counts devices per GPU: its books and ours must agree on every GPU.
        if Counter(device_ids.gpu_of(d) for d in devices) != dict.fromkeys(slot.indices, slot.share):
            self._refuse(
                pod,
                f"pod {chosen.key} container {slot.container!r} was placed on {slot.where}, but the kubelet gave "
                f"it devices {sorted(devices)[:8]} (it did not take gpushared's preferred allocation)",
            )
        if decision.ambiguous_but_equivalent:
            log.info(
                "Allocate: %s and %s wait for the same %d %s on %s; either is right",
                chosen.key,
                ", ".join(decision.ambiguous_but_equivalent),
                slot.amount,
                unit,
                slot.where,
            )
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        app_sum = sum(s.amount for s in chosen.slots or [] if not s.init)
        pod_total = annotations.get(contract.ALIYUN_GPU_MEM_POD, str(app_sum))
        given = self._exposure(pod, chosen.key, gpus)
        envs = {
            **given.envs,
            contract.ENV_GPU_MEM_IDX: ",".join(str(gpu.index) for gpu in gpus),
            contract.ENV_GPU_MEM_POD: pod_total,
            contract.ENV_GPU_MEM_CONTAINER: str(slot.amount),
            contract.ENV_GPU_MEM_DEV: str(gpus[0].memory),
        }
        mounts = [Mount(container_path=inside, host_path=outside, read_only=True) for inside, outside in given.mounts]
        request = pod_request(pod, resources=self.resources)  # type: ignore[arg-type]
        if request.mps:
            mps_envs, mps_mounts = self._mps_setup(
                pod, chosen=chosen, slot=slot, gpu=gpus[0], ledger=ledger, override=request.thread_percentage
            )
            envs.update(mps_envs)
            mounts += mps_mounts
        self._record(pod, slot, chosen.slots or [])
        log.info(
            "Allocate: pod %s container %r gets %d %s on %s (%s)",
            chosen.key,
            slot.container,
            slot.amount,
            unit,
            slot.where,
            ", ".join(gpu.uuid for gpu in gpus),
        )
        return ContainerAllocation(
            envs=envs,
            mounts=mounts,
            devices=given.devices,
            cdi_devices=given.cdi_devices,
        )

    def _exposure(self, pod: Any, key: str, gpus: Sequence[GpuInfo]) -> Exposure:
        """What the runtime needs to give the container these GPUs (core.exposure), per the node's policy."""
        with self._lock:
            minors = {g.uuid: g.minor for g in self._gpus}
        present: list[str] = []
        if self.exposure.device_nodes:
            root = self.exposure.dev_root
            present = [p for p in CONTROL_DEVICES if os.path.exists(os.path.join(root, p.lstrip("/")))]
        try:
            return exposure(
                self.exposure, [ExposedGpu(gpu.uuid, minors.get(gpu.uuid)) for gpu in gpus], control_present=present
            )
        except CannotExpose as exc:
            self._refuse(pod, f"pod {key}: {exc}")
            raise

    def _placed_gpu(self, inventory: GpuInventory, pod: Any, key: str, index: int, uuid: str | None) -> GpuInfo:
        """The GPU a pod was placed on, refused when the node no longer has it as it was."""
        gpu = inventory.by_index(index)
        if gpu is None:
            self._refuse(pod, f"pod {key} was placed on GPU {index}, which node {self.node} does not have")
        assert gpu is not None
        if uuid is not None and uuid != gpu.uuid:
            self._refuse(
                pod,
                f"pod {key} was placed on GPU {index} with UUID {uuid}, but GPU {index} of node "
                f"{self.node} is now {gpu.uuid}: the GPUs changed since it was scheduled; delete the pod",
            )
        return gpu

    def _mps_setup(
        self,
        pod: Any,
        *,
        chosen: handshake.Candidate,
        slot: handshake.Slot,
        gpu: GpuInfo,
        ledger: Ledger,
        override: int | None,
    ) -> tuple[dict[str, str], list[Mount]]:
        """An MPS pod's container: checked (one GPU, a running daemon, room for a client), then its env."""
        key = chosen.key
        if self.mps is None:
            self._refuse(
                pod,
                f"pod {key} asks for MPS ({contract.POD_MPS}), but node {self.node} runs no MPS daemons: "
                "set mps.enabled in the gpushared configuration, or remove the annotation",
            )
        assert self.mps is not None
        indices = sorted({index for s in chosen.slots or [] for index in s.indices})
        if len(indices) > 1:
            self._refuse(
                pod,
                f"pod {key} asks for MPS on GPUs {indices}: an MPS client reaches one GPU's daemon only; "
                "put its containers on one GPU or drop the annotation",
            )
        held = ledger.holding((pod.get("metadata") or {}).get("uid", "")) is not None
        clients = ledger.mps_clients(gpu.index) + (0 if held else 1)  # this pod counted once
        if clients > MAX_MPS_CLIENTS:
            self._refuse(
                pod,
                f"pod {key} would be MPS client {clients} of GPU {gpu.index}; an MPS server takes {MAX_MPS_CLIENTS}",
            )
        if not self.mps.running(gpu.uuid):
            self._refuse(
                pod, f"pod {key}: the MPS control daemon of GPU {gpu.index} is not running; see gpushared status"
            )
        device = self._device(gpu.uuid)
        percentage = thread_percentage(amount=slot.amount, gpu_memory=gpu.memory, override=override)
        return self.mps.container_setup(gpu=device, amount_mib=self.unit.to_mib(slot.amount), percentage=percentage)

    def _device(self, uuid: str) -> GpuDevice:
        with self._lock:
            return next(g for g in self._gpus if g.uuid == uuid)

    def _identify(self, size: int, *, deadline: float) -> handshake.Decision:
        """The container asking for ``size`` units; API reads end by ``deadline`` (time.monotonic)."""
        attempts = 3
        for attempt in range(attempts):
            try:
                return handshake.identify(size, self._candidates(deadline), unit=self.unit, node=self.node)
            except handshake.Unidentified as exc:
                if exc.retry and attempt < attempts - 1:
                    time.sleep(0.1)  # a rejected pod's status, a just-bound pod's watch event: let them land
                    continue
                self._refuse(exc.pod, exc.message)
        raise AssertionError("unreachable")

    def _candidates(self, deadline: float) -> list[handshake.Candidate]:
        try:
            listing: list[PodDevices] | None = list_pod_devices(self.pod_resources_socket, resource=self.resource_name)
        except grpc.RpcError as exc:
            log.warning("kubelet PodResources unavailable (%s): matching by annotations alone", exc.code())
            listing = None
        found = []
        if listing is not None:
            for entry in listing:
                if entry.containers and all(entry.containers.values()):
                    continue  # every app container has its devices: admitted long ago
                pod = self._pod(entry.namespace, entry.name, listed=entry.containers, deadline=deadline)
                if pod is None:
                    continue
                uid = (pod.get("metadata") or {}).get("uid", "")
                if uid in self._gpu_free:
                    continue
                served = set(self.served[uid].containers) if uid in self.served else set()
                option = handshake.candidate(
                    pod, listed=entry.containers, served=served, unit=self.unit, resources=self.resources
                )
                if option is not None:
                    found.append(option)
                elif not _asks_gpu_memory(pod, self.resources):
                    self._gpu_free.add(uid)  # a pod's spec never changes: never look at it again
            return found
        for pod in self.pods.pods() if self.pods is not None else []:
            uid = (pod.get("metadata") or {}).get("uid", "")
            served = set(self.served[uid].containers) if uid in self.served else set()
            option = handshake.candidate(pod, listed=None, served=served, unit=self.unit, resources=self.resources)
            if option is not None and option.slots is not None:
                found.append(option)
        return found

    def _pod(
        self, namespace: str, name: str, *, listed: dict[str, list[str]], deadline: float
    ) -> dict[str, Any] | None:
        """The pod's body from the watch; fetched (one pod, by name) only when it may be the one admitted."""
        pod = self.pods.find(namespace, name) if self.pods is not None else None
        if pod is not None or self._lookup is None:
            return pod
        if listed and all(listed.values()):
            return None  # every app container has devices: not being admitted
        left = deadline - time.monotonic()
        if left <= 0.05:
            raise AllocationRefused(
                f"cannot read pod {namespace}/{name} to find its GPU: the API server took the "
                f"{ALLOCATE_BUDGET_SECONDS:.0f} s an admission may wait",
                retryable=True,
            )
        try:
            pod = self._lookup.get_pod(namespace, name, timeout=left)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise AllocationRefused(
                f"cannot read pod {namespace}/{name} to find its GPU: {exc}", retryable=True
            ) from exc
        if (pod.get("spec") or {}).get("nodeName") != self.node:
            return None
        if self.pods is not None:
            self.pods.remember(pod)
        return pod

    def _refuse(self, pod: Any, message: str) -> None:
        if pod is not None:
            self._later(lambda: self._event(pod, EVENT_FAILED, message, warning=True))
        raise AllocationRefused(message)

    def _record(self, pod: Any, slot: handshake.Slot, slots: Sequence[handshake.Slot]) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid", "")
        served = self.served.setdefault(uid, Served(namespace=meta.get("namespace", ""), name=meta.get("name", "")))
        served.containers[slot.container] = slot
        self.metrics.allocations.inc()
        if all(s.container in served.containers for s in slots) and not served.assigned:
            served.assigned = True
            placed = ", ".join(f"{c} on {given.where}" for c, given in served.containers.items())
            self._later(lambda: self._mark_assigned(pod))
            self._later(lambda: self._event(pod, EVENT_ALLOCATED, f"GPU memory allocated: {placed}", warning=False))

    def forget_departed(self) -> None:
        """Drop what we served to pods that are gone, so a long-lived daemon's memory stays flat."""
        if self.pods is None or not self.pods.synced:
            return
        present = {(p.get("metadata") or {}).get("uid", "") for p in self.pods.pods()}
        with self._allocate_lock:
            for uid in [uid for uid in self.served if uid not in present]:
                del self.served[uid]
            self._gpu_free &= present
            self._edited &= present
            for uid in [uid for uid in self._holdings if uid not in present]:
                del self._holdings[uid]

    # --- writes, off the Allocate path ---------------------------------------------------------------------------

    def _later(self, write: Callable[[], None]) -> None:
        self._outbox.put(write)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued API writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._outbox.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def _write_loop(self) -> None:
        while True:
            write = self._outbox.get()
            try:
                for attempt in range(6):
                    try:
                        write()
                        break
                    except KubeError as exc:
                        log.warning("API write failed (%s); attempt %d", exc, attempt + 1)
                        time.sleep(min(0.2 * 2**attempt, 5.0))
            except Exception:
                log.exception("API write failed")
            finally:
                self._outbox.task_done()

    def _mark_assigned(self, pod: Any) -> None:
        if self.api is None:
            return
        meta = pod.get("metadata") or {}
        patch = {
            "metadata": {
                "annotations": {
                    contract.ALIYUN_GPU_MEM_ASSIGNED: contract.format_bool(True),
                    contract.ALIYUN_GPU_MEM_ASSUME_TIME: str(self.clock()),
                }
            }
        }
        try:
            updated = self.api.patch_pod(meta.get("namespace", ""), meta.get("name", ""), patch)
        except KubeError as exc:
            if exc.status == 404:
                return  # deleted meanwhile
            raise
        if self.pods is not None:
            self.pods.remember(updated)

    def _event(self, pod: Any, reason: str, message: str, *, warning: bool) -> None:
        if self.api is None:
            return
        try:
            self.api.pod_event(pod, reason=reason, message=message, warning=warning, component=COMPONENT)
        except KubeError as exc:
            if exc.status in (403, 404, 409, 422):
                log.warning("event on pod not written: %s", exc)
                return
            raise

    # --- status ------------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        inventory = self.inventory
        ledger = self.ledger()
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
                }
                for gpu in inventory.gpus
            ],
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


def _asks_gpu_memory(pod: dict[str, Any], resources: ResourceNames) -> bool:
    try:
        return pod_request(pod, resources=resources).total > 0  # type: ignore[arg-type]
    except contract.ContractError:
        return True


def _natural(device: str) -> tuple[int, int]:
    head, _, tail = device.partition("-")
    return (int(head) if head.isdigit() else -1, int(tail) if tail.isdigit() else -1)
