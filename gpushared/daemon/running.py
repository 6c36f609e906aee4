"""Everything the daemon runs once it reaches the API server, built whole and stopped whole.

Before it has credentials the daemon reads its GPUs and waits (``service.Service``); once it has them it
builds one :class:`Running` — the API client, the node's publisher and watches, the pod mirror, the MPS
supervisor where MPS is on, the manager, the memory watcher, the device plugin and its kubelet link — in
one step, as NVIDIA's device plugin builds and restarts its servers whole. Nothing in it is ever half
there: the loop that ticks it needs no None checks.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from gpushared.contract import ResourceNames
from gpushared.core.shared.bodies import NodeBody, PodBody
from gpushared.daemon.compute import ComputeWatcher
from gpushared.daemon.config import Config
from gpushared.daemon.credential import COMPONENT, TokenRenewer
from gpushared.daemon.dra.book import ClaimBook, DriverLock
from gpushared.daemon.dra.driver import DraDriver, DraLink
from gpushared.daemon.dra.kubelet import DraPluginServer
from gpushared.daemon.dra.slices import SlicePublisher, withdraw_stale
from gpushared.daemon.errors import FatalError
from gpushared.daemon.gpus import GpuReader
from gpushared.daemon.health import Health
from gpushared.daemon.manager import Manager
from gpushared.daemon.memory import ClaimsView, GpuView, MemoryWatcher
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.daemon.mps import MpsSupervisor, settings_of
from gpushared.daemon.node import KubeletLink, NodePublisher, node_watch
from gpushared.kube.api import Api, KubeError
from gpushared.kube.informer import Informer
from gpushared.kube.podwatch import PodWatch
from gpushared.kube.resources import ResourceApi
from gpushared.kubelet.deviceplugin.server import PluginServer
from gpushared.kubelet.podresources.client import list_pod_devices
from gpushared.nvml.backend import GpuBackend

log = logging.getLogger(__name__)

#: The device plugin's socket, in the kubelet's plugin directory.
ENDPOINT = "gpushared.sock"
#: The node's Event when the DRA checkpoint had damaged files, set aside at start.
EVENT_CHECKPOINT_DAMAGED = "DRACheckpointDamaged"


@dataclass(frozen=True)
class Parts:
    """What the daemon has before it connects, and every running part reads."""

    config: Config
    resources: ResourceNames
    backend: GpuBackend
    gpus: GpuReader
    health: Health
    metrics: DaemonMetrics


@dataclass(frozen=True)
class Running:
    api: Api
    node: NodePublisher
    pods: PodWatch
    node_watch: Informer[NodeBody]
    #: where the config turns MPS on (``mpsEnabled``); None where it is off, never "not yet"
    mps: MpsSupervisor | None
    manager: Manager
    memory: MemoryWatcher
    #: the device plugin's registration, or in DRA mode the DRA plugin's sockets and the node's slice
    kubelet: KubeletLink | DraLink
    #: renews the daemon's token where it is one that expires; None otherwise
    credential: TokenRenewer | None = None
    #: the prepared claims (DRA mode); None in device-plugin mode
    dra: DraDriver | None = None

    @classmethod
    def start(cls, parts: Parts, api: Api, *, stop: threading.Event) -> Running:
        """Build every part and start its threads; the MPS daemons are adopted (or started) before the first
        inventory goes out, so that a restart does not show every MPS GPU unhealthy to the kubelet and the
        scheduler for a probe interval."""
        config, metrics = parts.config, parts.metrics
        node = NodePublisher(
            api,
            config.node_name,
            resources=parts.resources,
            usage_seconds=config.inventory_usage_seconds,
            metrics=metrics,
        )
        pods = PodWatch(api, config.node_name)
        pods.start()
        watching_node = node_watch(api, config.node_name, node)
        watching_node.start()
        mps = None
        if config.mps_enabled:
            mps = MpsSupervisor(
                settings=settings_of(config), health=parts.health, metrics=metrics, backend=parts.backend
            )
            mps.sync(parts.gpus.devices)
            mps.check()
        manager = Manager(
            node=config.node_name,
            resources=parts.resources,
            unit=config.memory_unit,
            api=api,
            pods=pods,
            pod_resources_socket=config.pod_resources_socket,
            health=parts.health,
            metrics=metrics,
            mps=mps,
            exposure=config.exposure,
        )
        manager.refresh(parts.gpus.devices, parts.gpus.links)
        metrics.watch_pods(manager.pod_shares)
        dra = None
        kubelet: KubeletLink | DraLink
        if config.dra:
            dra, kubelet = _dra_driver(config, api, manager, watching_node, pods)
            driver = dra
            metrics.watch_claims(lambda: driver.shares(manager.inventory))
        memory = _memory_watcher(parts, manager, pods, dra)
        if dra is None:
            plugin = PluginServer(manager, plugin_dir=config.plugin_dir, endpoint=ENDPOINT)
            kubelet = KubeletLink(plugin, metrics=metrics)
            threading.Thread(
                target=withdraw_stale,
                args=(ResourceApi(api.rest),),
                kwargs={"node": config.node_name, "driver": config.dra_driver},
                name="stale-slices",
                daemon=True,
            ).start()
        renewer = None
        if config.renewed_token_file is not None:
            renewer = TokenRenewer.attach(api, saved=config.renewed_token_file, node=config.node_name, metrics=metrics)
        running = cls(
            credential=renewer,
            api=api,
            node=node,
            pods=pods,
            node_watch=watching_node,
            mps=mps,
            manager=manager,
            memory=memory,
            kubelet=kubelet,
            dra=dra,
        )
        if renewer is not None:
            threading.Thread(target=renewer.run, args=(stop,), name="token-renewal", daemon=True).start()
        if mps is not None:
            threading.Thread(target=mps.run, args=(stop,), name="mps", daemon=True).start()
        threading.Thread(target=memory.run, args=(stop,), name="gpu-memory", daemon=True).start()
        if config.health_enabled:
            watch = parts.gpus.watch_events
            threading.Thread(target=watch, args=(stop, metrics), name="gpu-events", daemon=True).start()
        return running

    def stop(self) -> None:
        """Stop serving; the MPS control daemons keep running (quitting them would cut off every MPS client
        on the node; the next gpushared adopts them)."""
        self.kubelet.stop()
        self.pods.stop()
        self.node_watch.stop()
        self.manager.flush(timeout=3.0)

    @property
    def registered(self) -> bool:
        return self.kubelet.registered


def _dra_driver(
    config: Config, api: Api, manager: Manager, node: Informer[NodeBody], pods: PodWatch
) -> tuple[DraDriver, DraLink]:
    """The DRA mode's parts (docs/dra.md): the claims prepared before a restart read back first, so that
    the kubelet's first call after it gets the answers it got before."""
    resources = ResourceApi(api.rest)
    try:
        served = resources.served()
    except KubeError:
        served = True  # not reachable now: the slice's publication will say so, and try again
    if not served:
        raise FatalError(
            "mode: dra needs the API server to serve resource.k8s.io/v1 (Kubernetes 1.34 or later); "
            "this one does not: use mode: device-plugin on this cluster"
        )
    lock = DriverLock(config.dra_lock)
    holder = lock.acquire()  # held for the process's life: the kernel drops it however the daemon ends
    if holder is not None:
        raise FatalError(
            f"another gpushared already serves DRA on this node ({holder} holds {config.dra_lock}): "
            "run one per node (the .deb's unit or the chart's DaemonSet, not both)"
        )
    book = ClaimBook(directory=config.dra_checkpoint, cdi_root=config.cdi_root, legacy=config.dra_legacy_checkpoint)
    damaged = book.load()
    if damaged:
        threading.Thread(
            target=_report_damage, args=(api, config.node_name, damaged), name="dra-damage", daemon=True
        ).start()
    # Claims are read once per try: the driver tries again itself, within the kubelet's deadline.
    reader = ResourceApi(api.rest.without_retries())
    once = api.without_retries()

    def read_pod(namespace: str, name: str, timeout: float) -> PodBody:
        """A pod the claim is reserved for: the node's pod watch has it (the kubelet prepares for pods bound
        here), read from the API server only when the watch has not seen it yet."""
        return pods.find(namespace, name) or once.get_pod(namespace, name, timeout=timeout)

    driver = DraDriver(node=config.node_name, api=reader, book=book, facts=manager.facts, read_pod=read_pod)
    driver.lock = lock  # held as long as the driver serves
    plugin = DraPluginServer(driver, driver=config.dra_driver, kubelet_dir=config.kubelet_dir)
    plugin.start()

    def node_uid() -> str | None:
        body = node.get("", config.node_name)
        return None if body is None else (body.get("metadata") or {}).get("uid")

    slices = SlicePublisher(resources, node=config.node_name, node_uid=node_uid, driver=config.dra_driver)
    return driver, DraLink(plugin, slices, lambda: manager.inventory)


def _report_damage(api: Api, node: str, damaged: list[str]) -> None:
    """What the DRA checkpoint set aside, as a warning Event on the node (the log has it already)."""
    message = f"{len(damaged)} damaged DRA checkpoint file(s) set aside: " + "; ".join(damaged)
    try:
        api.node_event(node, reason=EVENT_CHECKPOINT_DAMAGED, message=message[:1000], warning=True, component=COMPONENT)
    except KubeError as exc:
        log.warning("could not report the damaged checkpoint as an Event: %s", exc)


def _memory_watcher(parts: Parts, manager: Manager, pods: PodWatch, dra: DraDriver | None) -> MemoryWatcher:
    """The memory watcher (docs/memory.md). It runs with the node's enforcement off too: a pod's
    annotation may still ask for report or kill."""
    config = parts.config
    return MemoryWatcher(
        backend=parts.backend,
        gpus=lambda: [GpuView(g.index, g.uuid, g.memory_mib) for g in manager.inventory.gpus],
        pods=pods.pods,
        outbox=manager.outbox,
        metrics=parts.metrics,
        unit=config.memory_unit,
        resources=parts.resources,
        enforcement=config.memory_enforcement,
        policy=config.memory_policy,
        poll_seconds=config.memory_poll_seconds,
        pod_devices=lambda: list_pod_devices(config.pod_resources_socket, resource=parts.resources.gpu_mem),
        pods_version=lambda: pods.changes,
        compute=ComputeWatcher(backend=parts.backend, outbox=manager.outbox, metrics=parts.metrics),
        claims=None if dra is None else ClaimsView(claims=dra.book.by_name, version=lambda: dra.book.version),
    )
