"""The daemon's main loop: GPUs in, kubelet registration kept alive, inventory out, systemd told.

One loop, ticking twice a second, does everything that must keep happening; the systemd watchdog is fed
from it and nowhere else, so a loop that hangs (on NVML, on a lock) stops the pings and systemd restarts
the daemon. Work that may block for long — gRPC calls from the kubelet, the pod watch, GPU events, API
writes — runs on threads of its own and never holds the loop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import sdnotify

from gpushared import __version__
from gpushared.contract import ResourceNames
from gpushared.core.bodies import NodeBody
from gpushared.daemon import config as config_module
from gpushared.daemon import endpoints
from gpushared.daemon.config import Config
from gpushared.daemon.devices import DeviceListTooLarge, check_message_size
from gpushared.daemon.errors import FatalError
from gpushared.daemon.gpus import GpuReader
from gpushared.daemon.health import Health
from gpushared.daemon.manager import Manager, inventory_of
from gpushared.daemon.memory import GpuView, MemoryWatcher
from gpushared.daemon.metrics import Metrics
from gpushared.daemon.mps import MpsSupervisor, missing_mps_privilege, settings_of
from gpushared.daemon.node import KubeletLink, NodePublisher, node_watch
from gpushared.deviceplugin.podresources.client import list_pod_devices
from gpushared.deviceplugin.server import PluginServer
from gpushared.kube.api import Api, KubeError, NoCredentials, connect
from gpushared.kube.informer import Informer
from gpushared.kube.podwatch import PodWatch
from gpushared.nvml.backend import GpuBackend

log = logging.getLogger(__name__)

#: The main loop's period: kubelet restarts, reloads and health changes are acted on within it.
TICK = 1.0
#: How often what was served to departed pods is dropped and the GPU-use gauges are set regardless of the
#: pods' mirror: each a scan of every pod of the node, which at 10 s was a third of an idle daemon's CPU.
FORGET_SECONDS = 60.0
ENDPOINT = "gpushared.sock"


class Notifier:
    """sd_notify, and the watchdog interval systemd asked for (sdnotify does not read WATCHDOG_USEC)."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self.enabled else None
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self._last_ping = 0.0
        self._status = ""

    def send(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)

    def status(self, text: str) -> None:
        if text != self._status:
            self._status = text
            self.send(f"STATUS={text}")
            log.info("status: %s", text)

    @property
    def text(self) -> str:
        """The last STATUS= line: what the daemon is doing, in the words `systemctl status` shows."""
        return self._status

    def ping_if_due(self) -> None:
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval:
            self._last_ping = now
            self.send("WATCHDOG=1")


class Service:
    def __init__(self, config: Config, *, backend: GpuBackend, config_path: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.backend = backend
        self.resources = ResourceNames(domain=config.resource_domain)
        self.metrics = Metrics()
        self.health = Health(ignored_xids=config.ignored_xids, recover_after=config.recover_after)
        self.notifier = Notifier()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self.gpus = GpuReader(backend, health=self.health)
        self.api: Api | None = None
        self.pods: PodWatch | None = None
        self.manager: Manager | None = None
        self.mps: MpsSupervisor | None = None
        self.plugin: PluginServer | None = None
        self.memory: MemoryWatcher | None = None  # set with the manager
        self.kubelet: KubeletLink | None = None
        self.node: NodePublisher | None = None
        self.node_watch: Informer[NodeBody] | None = None
        self._http: endpoints.Endpoints | None = None
        self._kubeconfig_seen: int | None = None  # mtime of the kubeconfig last tried, while waiting for one
        self._gpus_due = 0.0  # monotonic time of the next NVML reading of the GPUs
        self._forget_due = 0.0  # and of the next dropping of what was served to pods now gone
        self._reported: tuple[object, ...] | None = None  # the ledger the GPU-use gauges were last set from

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def request_reload(self, *_: object) -> None:
        self._reload.set()

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)

    def run(self) -> None:
        self.notifier.send(f"MAINPID={os.getpid()}")
        self.notifier.status("starting")
        try:
            self._start()
            # READY means "running and retrying on its own", not "registered": the unit is ordered before
            # the kubelet, so waiting for the kubelet here would hold the boot (and `apt install`) forever.
            self.notifier.send("READY=1")
            while not self._stop.is_set():
                if self.manager is None:
                    self._wait_for_credentials()
                else:
                    self._tick()
                # Never longer than the watchdog's ping interval (half of WatchdogSec): the pings are the loop's.
                self._stop.wait(min(TICK, self.notifier.watchdog_interval or TICK))
        finally:
            self.notifier.send("STOPPING=1")
            self.notifier.status("stopping")
            self._shutdown()
            log.info("stopped")

    def _start(self) -> None:
        if self.config.mps_enabled:
            missing = missing_mps_privilege()
            if missing:
                raise FatalError(missing)
        self.gpus.read()
        if self.gpus.devices:
            try:
                check_message_size(inventory_of(self.gpus.devices, unit=self.config.memory_unit, health=self.health))
            except DeviceListTooLarge as exc:
                raise FatalError(str(exc)) from None
        if self.config.metrics_port or self.config.metrics_socket is not None:
            self._http = endpoints.Endpoints(
                self.config.metrics_address,
                self.config.metrics_port,
                registry=self.metrics.registry,
                status=self.status,
                pod_names=self.config.metrics_pod_names,
                local=self.config.metrics_socket,
            )
        self._connect()

    def _connect(self) -> None:
        """Reach the API server and start serving; without credentials yet, leave that to the loop."""
        try:
            api = Api(connect(self.config.kubeconfig))
        except NoCredentials as exc:
            self.notifier.status(f"{exc}; waiting for it (/usr/share/gpushared/node-kubeconfig writes one)")
            return
        except Exception as exc:  # KubeError, or a kubeconfig that does not parse
            raise FatalError(str(exc) if isinstance(exc, KubeError) else f"{self.config.kubeconfig}: {exc}") from None
        self.api = api
        self.node = NodePublisher(
            api,
            self.config.node_name,
            resources=self.resources,
            usage_seconds=self.config.inventory_usage_seconds,
            metrics=self.metrics,
        )
        self._serve()

    def _wait_for_credentials(self) -> None:
        """A node set up in this order — package, then kubeconfig — must not need a restart. A kubeconfig
        that appears meanwhile may be half-written (`kubectl config set-...` writes it one step at a time):
        it is read again whenever it changes, until it works."""
        self.notifier.ping_if_due()
        if self._reload.is_set():
            self._reload.clear()
            self._apply_reload()
        try:
            changed = self.config.kubeconfig.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if changed == self._kubeconfig_seen:
            return
        self._kubeconfig_seen = changed
        try:
            self._connect()
        except FatalError as exc:
            self.notifier.status(f"{exc}; waiting for a kubeconfig that works")

    def _serve(self) -> None:
        assert self.api is not None
        assert self.node is not None
        self.pods = PodWatch(self.api, self.config.node_name)
        self.pods.start()
        self.node_watch = node_watch(self.api, self.config.node_name, self.node)
        self.node_watch.start()
        if self.config.mps_enabled:
            self.mps = MpsSupervisor(
                settings=settings_of(self.config),
                health=self.health,
                metrics=self.metrics,
                backend=self.backend,
            )
            self.mps.sync(self.gpus.devices)
            # Adopt (or start) the daemons before the first inventory goes out, so that a gpushared restart
            # does not show every MPS GPU unhealthy to the kubelet and the scheduler for a probe interval.
            self.mps.check()
        self.manager = Manager(
            node=self.config.node_name,
            resources=self.resources,
            unit=self.config.memory_unit,
            api=self.api,
            pods=self.pods,
            pod_resources_socket=self.config.pod_resources_socket,
            health=self.health,
            metrics=self.metrics,
            mps=self.mps,
            exposure=self.config.exposure,
        )
        self.manager.refresh(self.gpus.devices, self.gpus.links)
        self.metrics.watch_pods(self.manager.pod_shares)
        self.memory = self._memory_watcher(self.manager, self.pods)
        if self.mps is not None:
            threading.Thread(target=self.mps.run, args=(self._stop,), name="mps", daemon=True).start()
        self.plugin = PluginServer(self.manager, plugin_dir=self.config.plugin_dir, endpoint=ENDPOINT)
        self.kubelet = KubeletLink(self.plugin, metrics=self.metrics)
        if self.memory is not None:
            threading.Thread(target=self.memory.run, args=(self._stop,), name="gpu-memory", daemon=True).start()
        if self.config.health_enabled:
            watch = self.gpus.watch_events
            threading.Thread(target=watch, args=(self._stop, self.metrics), name="gpu-events", daemon=True).start()

    def _memory_watcher(self, manager: Manager, pods: PodWatch) -> MemoryWatcher:
        """The memory watcher (docs/memory.md). It runs with the node's enforcement off too: a pod's
        annotation may still ask for report or kill."""
        return MemoryWatcher(
            backend=self.backend,
            gpus=lambda: [GpuView(g.index, g.uuid, g.memory_mib) for g in manager.inventory.gpus],
            pods=pods.pods,
            outbox=manager.outbox,
            metrics=self.metrics,
            unit=self.config.memory_unit,
            resources=self.resources,
            enforcement=self.config.memory_enforcement,
            policy=self.config.memory_policy,
            poll_seconds=self.config.memory_poll_seconds,
            pod_devices=lambda: list_pod_devices(self.config.pod_resources_socket, resource=self.resources.gpu_mem),
        )

    def _shutdown(self) -> None:
        if self.plugin is not None:
            self.plugin.stop()
        if self.mps is not None:
            # Quitting them would cut off every MPS client on the node; the next gpushared adopts them.
            log.info("MPS control daemons keep running (gpushared mps stop quits them)")
        if self.pods is not None:
            self.pods.stop()
        if self.node_watch is not None:
            self.node_watch.stop()
        if self.manager is not None:
            self.manager.flush(timeout=3.0)
        if self._http is not None:
            self._http.close()
        self.backend.stop()

    # --- the loop ------------------------------------------------------------------------------------------------

    def _tick(self) -> None:
        self.notifier.ping_if_due()
        if self._reload.is_set():
            self._reload.clear()
            self._apply_reload()
        assert self.manager is not None
        now = time.monotonic()
        if now >= self._gpus_due:  # NVML is asked again every gpuPollSeconds; events come in between
            self._gpus_due = now + self.config.gpu_poll_seconds
            self.gpus.read()
            if self.mps is not None:
                self.mps.sync(self.gpus.devices)
        if self.gpus.ok:
            self.manager.refresh(self.gpus.devices, self.gpus.links)
        else:
            self.manager.recheck_health()
        assert self.kubelet is not None, "set with the manager"
        assert self.node is not None, "set with the API client"
        self.kubelet.keep()
        self.node.check()
        if now >= self._forget_due:  # a scan of every pod on the node: departed pods need not go at once
            self._forget_due = now + FORGET_SECONDS
            self.manager.forget_departed()
            self._reported = None  # and the gauges set again, whatever the key says
        # Every tick: the publisher writes only what changed, and the GPUs' use at its own pace.
        self.node.publish(self.manager.inventory, usage=self.memory.gpu_usage() if self.memory else None)
        self._report()

    def _report(self) -> None:
        assert self.manager is not None
        inventory = self.manager.inventory
        unhealthy = [g.index for g in inventory.gpus if not g.healthy]
        if not self.gpus.ok and not inventory.gpus:
            text = "no GPUs: NVML unavailable; waiting"
        elif not inventory.gpus:
            text = "no GPUs found; waiting"
        elif not self.registered:
            text = f"{len(inventory.gpus)} GPUs; waiting for the kubelet at {self.config.plugin_dir}"
        else:
            text = f"serving {len(inventory.gpus)} GPUs, {inventory.total} {inventory.unit.value}"
            if unhealthy:
                text += f"; unhealthy: {', '.join(map(str, unhealthy))}"
        self.notifier.status(text)
        # Building the ledger reads every pod of the node: twice a second for a gauge that changes only with
        # the pods or the GPUs was most of what an idle daemon spent (docs/benchmarks.md, "Idle, again").
        key = self.manager.ledger_key()
        if key == self._reported:
            return
        self._reported = key
        ledger = self.manager.ledger()
        for gpu in inventory.gpus:
            used = self.config.memory_unit.to_bytes(ledger.used(gpu.index))
            self.metrics.gpu_used.labels(gpu=str(gpu.index), uuid=gpu.uuid).set(used)

    def _apply_reload(self) -> None:
        """SIGHUP: re-read the config; apply what can change live, name what needs a restart."""
        path = self.config_path or config_module.DEFAULT_PATH
        try:
            fresh = config_module.load(path)
        except config_module.ConfigError as exc:
            log.error("reload refused, keeping the running configuration: %s", exc)
            return
        logging.getLogger().setLevel(fresh.log_level.upper())
        self.health.ignored = frozenset(fresh.ignored_xids)
        self.health.recover_after = fresh.recover_after
        live = {"log_level", "ignored_xids", "recover_after"}
        later = [
            name for name in vars(fresh) if name not in live and getattr(fresh, name) != getattr(self.config, name)
        ]
        if later:
            log.warning("reload: %s change only after a restart", ", ".join(sorted(later)))
        log.info("configuration reloaded from %s", path)

    @property
    def registered(self) -> bool:
        return self.kubelet is not None and self.kubelet.registered

    # --- status and metrics -----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        served: dict[str, Any] = (
            self.manager.status()
            if self.manager is not None
            else {
                "node": self.config.node_name,
                "resource": self.resources.gpu_mem,
                "unit": "-",
                "gpus": [],
                "pods": [],
            }
        )
        return {
            "version": __version__,
            "state": self.notifier.text,
            "registered": self.registered,
            "kubeletWatching": self.plugin is not None and self.plugin.watched,
            "mps": self.mps.status() if self.mps is not None else None,
            "memory": self.memory.status() if self.memory is not None else None,
            "kubelet": str(self.config.plugin_dir),
            "nvml": self.gpus.ok,
            **served,
        }
