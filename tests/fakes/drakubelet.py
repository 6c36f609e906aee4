"""A fake kubelet DRA manager: the other end of plugin registration and the DRA gRPC service, over real
unix sockets, as the kubelet (1.32 through current) behaves:

- its plugin watcher looks at ``<root>/plugins_registry`` for sockets; for a new one it calls ``GetInfo``,
  takes a plugin of type ``DRAPlugin``, picks the newest service version it speaks from the plugin's
  ``supported_versions`` (``speaks``: v1 and v1beta1 for a 1.34+ kubelet, v1beta1 alone for 1.32-1.33), dials
  the plugin's endpoint and tells the plugin with ``NotifyRegistrationStatus``; a socket that goes away
  deregisters its driver;
- :meth:`prepare` and :meth:`unprepare` call the driver's service as the kubelet's claim manager does before
  a pod's containers start and after they stop: one call per driver, every claim of the pod in it;
- :meth:`restart` forgets every plugin and looks at the directory afresh, as a restarted kubelet does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpushared.kubelet.dra.v1 import api_pb2 as v1
from gpushared.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from gpushared.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from gpushared.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpushared.kubelet.pluginregistration.v1 import api_pb2 as registration
from gpushared.kubelet.pluginregistration.v1 import api_pb2_grpc as registration_grpc

#: service name -> (message module, stub), newest first
SERVICES: dict[str, tuple[Any, Any]] = {
    "v1.DRAPlugin": (v1, v1_grpc.DRAPluginStub),
    "v1beta1.DRAPlugin": (v1beta1, v1beta1_grpc.DRAPluginStub),
}


@dataclass
class Plugin:
    driver: str
    registration_socket: Path
    endpoint: str
    service: str
    channel: grpc.Channel
    #: the registration socket's inode when it registered: a restarted plugin makes a new one
    inode: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str


class FakeDraKubelet:
    def __init__(self, root: Path, *, speaks: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")) -> None:
        self.root = root
        self.speaks = speaks
        self.plugins: dict[str, Plugin] = {}
        #: (driver or socket, error) of each registration refused
        self.refusals: list[tuple[str, str]] = []
        #: driver -> how many times it registered (a restarted plugin registers again)
        self.registrations: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def registry(self) -> Path:
        return self.root / "plugins_registry"

    def start(self) -> FakeDraKubelet:
        self.registry.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="fake-plugin-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            for plugin in self.plugins.values():
                plugin.channel.close()
            self.plugins.clear()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> FakeDraKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the plugin watcher ----------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.is_set():
            present = {p: _inode(p) for p in self.registry.glob("*.sock") if p.is_socket()}
            with self._lock:
                known = {p.registration_socket: (name, p.inode) for name, p in self.plugins.items()}
            registered = set()
            for path, (name, inode) in known.items():
                if present.get(path) == inode:
                    registered.add(path)
                else:  # gone, or made again by a restarted plugin (inotify tells the real watcher either)
                    with self._lock:
                        self.plugins.pop(name).channel.close()
            for path in set(present) - registered:
                self._register(path)
            self._stop.wait(0.1)

    def _register(self, path: Path) -> None:
        try:
            with grpc.insecure_channel(f"unix://{path}") as channel:
                stub = registration_grpc.RegistrationStub(channel)
                info = stub.GetInfo(registration.InfoRequest(), timeout=5)
                if info.type != "DRAPlugin":
                    return  # a CSI driver's: not ours to take
                service = next((s for s in info.supported_versions if s in self.speaks), None)
                if service is None:
                    offered, spoken = list(info.supported_versions), list(self.speaks)
                    error = f"none of the versions {offered} is supported (kubelet speaks {spoken})"
                    self.refusals.append((info.name, error))
                    stub.NotifyRegistrationStatus(
                        registration.RegistrationStatus(plugin_registered=False, error=error), timeout=5
                    )
                    return
                channel_to = grpc.insecure_channel(f"unix://{info.endpoint}")
                plugin = Plugin(info.name, path, info.endpoint, service, channel_to, inode=_inode(path))
                with self._lock:
                    self.plugins[info.name] = plugin
                    self.registrations[info.name] = self.registrations.get(info.name, 0) + 1
                stub.NotifyRegistrationStatus(registration.RegistrationStatus(plugin_registered=True), timeout=5)
        except grpc.RpcError as exc:
            self.refusals.append((str(path), f"{exc.code()}: {exc.details()}"))
            time.sleep(0.2)  # the real watcher retries on the next event; this one on its next look

    def wait_for(self, driver: str, *, timeout: float = 10, times: int = 1) -> Plugin:
        """The driver's plugin once it has registered ``times`` times in all (a restarted one registers again)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                plugin = self.plugins.get(driver)
                enough = self.registrations.get(driver, 0) >= times
            if plugin is not None and enough:
                return plugin
            time.sleep(0.05)
        raise AssertionError(f"DRA driver {driver} did not register; refusals: {self.refusals}")

    # --- the claim manager -----------------------------------------------------------------------------------

    def prepare(self, driver: str, *claims: Claim, timeout: float = 45) -> dict[str, Any]:
        """claim UID -> the driver's answer for it (a NodePrepareResourceResponse)."""
        plugin = self.plugins[driver]
        pb, stub = SERVICES[plugin.service]
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        )
        return dict(stub(plugin.channel).NodePrepareResources(request, timeout=timeout).claims)

    def unprepare(self, driver: str, *claims: Claim, timeout: float = 45) -> dict[str, str]:
        plugin = self.plugins[driver]
        pb, stub = SERVICES[plugin.service]
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        )
        answer = stub(plugin.channel).NodeUnprepareResources(request, timeout=timeout)
        return {uid: entry.error for uid, entry in answer.claims.items()}


def _inode(path: Path) -> tuple[int, int]:
    """Which file is at ``path`` now: its inode and change time (a socket made again is another file)."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return (-1, -1)
    return (found.st_ino, found.st_ctime_ns)
