"""The daemon's main loop: GPUs in, kubelet registration kept alive, inventory out, systemd told.

One loop, ticking twice a second, does everything that must keep happening; the systemd watchdog is fed
from it and nowhere else, so a loop that hangs (on NVML, on a lock) stops the pings and systemd restarts
the daemon. Work that may block for long — gRPC calls from the kubelet, the pod watch, GPU events, API
writes — runs on threads of its own and never holds the loop.

Until it reaches the API server the daemon reads its GPUs and waits for credentials; then it builds
everything else at once (``running.Running``) and ticks that.
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
from gpushared.daemon import config as config_module
from gpushared.daemon import endpoints
from gpushared.daemon.config import Config
from gpushared.daemon.devices import DeviceListTooLarge, check_message_size
from gpushared.daemon.errors import FatalError
from gpushared.daemon.gpus import GpuReader
from gpushared.daemon.health import Health
from gpushared.daemon.healthport import HealthListener
from gpushared.daemon.manager import inventory_of
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.daemon.mps import missing_mps_privilege
from gpushared.daemon.running import Parts, Running
from gpushared.kube.api import Api, KubeError, NoCredentials, connect
from gpushared.nvml.backend import GpuBackend

log = logging.getLogger(__name__)

#: The main loop's period: kubelet restarts, reloads and health changes are acted on within it.
TICK = 1.0
#: How often what was served to departed pods is dropped and the GPU-use gauges are set regardless of the
#: pods' mirror: each a scan of every pod of the node, which at 10 s was a third of an idle daemon's CPU.
FORGET_SECONDS = 60.0
#: What a SIGHUP applies at once (``Config`` field names); any other change waits for a restart.
LIVE_OPTIONS = frozenset({"log_level", "ignored_xids", "recover_after"})


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
        self.metrics = DaemonMetrics(hostname=config.node_name)
        self.health = Health(ignored_xids=config.ignored_xids, recover_after=config.recover_after)
        self.notifier = Notifier()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self.gpus = GpuReader(backend, health=self.health)
        #: everything that runs once the API server is reached (None until then)
        self.running: Running | None = None
        self._http: endpoints.Endpoints | None = None  # None where the config asks for no listener
        self._health: HealthListener | None = None  # /healthz on its own port (metrics.healthPort)
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
                if self.running is None:
                    self._wait_for_credentials()
                else:
                    self._tick(self.running)
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
        if self.config.metrics_health_port:
            try:
                self._health = HealthListener(self.config.metrics_address, self.config.metrics_health_port)
            except OSError as exc:
                raise FatalError(
                    f"metrics.healthPort {self.config.metrics_health_port} on {self.config.metrics_address}: "
                    f"{exc.strerror}"
                ) from None
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
        credentials = api.rest.credentials
        log.info("API server %s, as %s", credentials.server, credentials.source)
        parts = Parts(self.config, self.resources, self.backend, self.gpus, self.health, self.metrics)
        self.running = Running.start(parts, api, stop=self._stop)

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

    def _shutdown(self) -> None:
        if self.running is not None:
            if self.running.mps is not None:
                log.info("MPS control daemons keep running (gpushared mps stop quits them)")
            self.running.stop()
        if self._http is not None:
            self._http.close()
        if self._health is not None:
            self._health.close()
        self.backend.stop()

    # --- the loop ------------------------------------------------------------------------------------------------

    def _tick(self, running: Running) -> None:
        self.notifier.ping_if_due()
        if self._reload.is_set():
            self._reload.clear()
            self._apply_reload()
        manager = running.manager
        now = time.monotonic()
        if now >= self._gpus_due:  # NVML is asked again every gpuPollSeconds; events come in between
            self._gpus_due = now + self.config.gpu_poll_seconds
            self.gpus.read()
            if running.mps is not None:
                running.mps.sync(self.gpus.devices)
        if self.gpus.ok:
            manager.refresh(self.gpus.devices, self.gpus.links)
        else:
            manager.recheck_health()
        running.kubelet.keep()
        running.node.check()
        if now >= self._forget_due:  # a scan of every pod on the node: departed pods need not go at once
            self._forget_due = now + FORGET_SECONDS
            manager.forget_departed()
            self._reported = None  # and the gauges set again, whatever the key says
        # Every tick: the publisher writes only what changed, and the GPUs' use at its own pace.
        running.node.publish(manager.inventory, usage=running.memory.gpu_usage())
        self._report(running)

    def _report(self, running: Running) -> None:
        manager = running.manager
        inventory = manager.inventory
        unhealthy = [g.index for g in inventory.gpus if not g.healthy]
        if not self.gpus.ok and not inventory.gpus:
            text = "no GPUs: NVML unavailable; waiting"
        elif not inventory.gpus:
            text = "no GPUs found; waiting"
        elif not running.registered:
            where = self.config.kubelet_dir / "plugins_registry" if self.config.dra else self.config.plugin_dir
            text = f"{len(inventory.gpus)} GPUs; waiting for the kubelet at {where}"
        elif running.dra is not None:
            text = f"serving {len(inventory.gpus)} GPUs to DRA claims ({len(running.dra.book.claims())} prepared)"
        else:
            text = f"serving {len(inventory.gpus)} GPUs, {inventory.total} {inventory.unit.value}"
            if unhealthy:
                text += f"; unhealthy: {', '.join(map(str, unhealthy))}"
        self.notifier.status(text)
        # Building the ledger reads every pod of the node: twice a second for a gauge that changes only with
        # the pods or the GPUs was most of what an idle daemon spent (docs/benchmarks.md, "Idle, again").
        key = (manager.ledger_key(), running.dra.book.version if running.dra is not None else 0)
        if key == self._reported:
            return
        self._reported = key
        ledger = manager.ledger()
        claimed = running.dra.claimed() if running.dra is not None else {}  # DRA mode: the prepared claims
        for gpu in inventory.gpus:
            memory, compute = claimed.get(gpu.index, (0, 0))
            used = self.config.memory_unit.to_bytes(ledger.used(gpu.index) + memory)
            labels = self.metrics.gpu_labels(gpu)
            self.metrics.gpu_used.labels(**labels).set(used)
            self.metrics.gpu_compute_requested.labels(**labels).set((ledger.compute_used(gpu.index) + compute) / 100)

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
        later = [
            name
            for name in vars(fresh)
            if name not in LIVE_OPTIONS and getattr(fresh, name) != getattr(self.config, name)
        ]
        if later:
            log.warning("reload: %s change only after a restart", ", ".join(sorted(later)))
        log.info("configuration reloaded from %s", path)

    @property
    def registered(self) -> bool:
        return self.running is not None and self.running.registered

    # --- status and metrics -----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        running = self.running
        served: dict[str, Any] = (
            running.manager.status()
            if running is not None
            else {
                "node": self.config.node_name,
                "resource": self.resources.gpu_mem,
                "unit": "-",
                "gpus": [],
                "pods": [],
            }
        )
        claims = running.dra.status() if running is not None and running.dra is not None else None
        if running is not None and running.dra is not None:  # DRA mode: a GPU's use is its claims'
            held = running.dra.claimed()
            for gpu in served["gpus"]:
                gpu["used"] += held.get(gpu["index"], (0, 0))[0]
        return {
            "version": __version__,
            "state": self.notifier.text,
            "registered": self.registered,
            "kubeletWatching": running is not None and running.kubelet.watched,
            "mode": self.config.mode,
            **({"driver": self.config.dra_driver} if self.config.dra else {}),
            "claims": claims,
            "mps": running.mps.status() if running is not None and running.mps is not None else None,
            "memory": running.memory.status() if running is not None else None,
            "kubelet": str(self.config.plugin_dir),
            "nvml": self.gpus.ok,
            **served,
        }
