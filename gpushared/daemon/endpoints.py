"""The daemon's HTTP endpoints for people and Prometheus: ``/metrics``, ``/status`` (JSON) and ``/healthz``.

Read-only, on threads of their own: nothing asked here changes the daemon or waits on its loop. The
kubelet speaks to the daemon over gRPC elsewhere (``gpushared.kubelet.deviceplugin.server``).

Two listeners, two audiences, so that strangers on the network learn no names:

- the **TCP port** (``metrics.address``:``metrics.port``, 9402 on every address by default) is reachable by
  anyone on the network, so it answers without names: ``/metrics`` without the per-pod and per-container
  series (their labels name namespaces and pods), ``/status`` without pods' names, GPU UUIDs or paths
  (:func:`anonymous`). ``metrics.podNames: true`` serves everything there, for clusters whose network
  keeps others off the port, as the extender's ``--public-pod-names`` does.
- the **local socket** (``metrics.socket``, ``/run/gpushared/status.sock``, mode 0600: root only) serves
  everything to the callers the filesystem authenticates: ``gpushared status``.

Each listener serves at most ``MAX_CONNECTIONS`` connections at once and closes the rest as it accepts
them; a connection gets ``IDLE_SECONDS`` per read and ``REQUEST_SECONDS`` in all. 1,017 idle connections
once took every descriptor of the process (a thread each, no limit), and the pod watch, API writes and
PodResources failed with EMFILE.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

#: Connections served at once, per listener; more are closed as they are accepted.
MAX_CONNECTIONS = 16
#: A connection that sends nothing for this long is closed.
IDLE_SECONDS = 5.0
#: A connection is closed this long after it was accepted, whatever it is doing (a client trickling bytes).
REQUEST_SECONDS = 10.0
#: Series whose labels name namespaces, pods or containers: only for callers allowed to see names.
NAMED_FAMILIES = frozenset(
    {
        "gpushared_pod_gpu_memory_bytes",
        "gpushared_claim_gpu_memory_bytes",
        "gpushared_container_gpu_memory_used_bytes",
        "gpushared_container_gpu_memory_allocated_bytes",
    }
)
#: What /status tells a caller who may not see names: the daemon's state and each GPU by index.
_ANONYMOUS_KEYS = (
    "version",
    "state",
    "registered",
    "kubeletWatching",
    "nvml",
    "node",
    "resource",
    "unit",
    "links",
    "mode",
)
_ANONYMOUS_GPU_KEYS = ("index", "model", "memory", "used", "healthy", "problem", "numa")


def anonymous(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` without what names tenants or the machine's layout: pods' names, GPU UUIDs, the kubelet's
    directory, MPS pipes; pods are counted, not listed."""
    shown = {key: status[key] for key in _ANONYMOUS_KEYS if key in status}
    shown["gpus"] = [{key: gpu.get(key) for key in _ANONYMOUS_GPU_KEYS} for gpu in status.get("gpus") or []]
    shown["pods"] = len(status.get("pods") or [])
    if status.get("claims") is not None:
        shown["claims"] = len(status["claims"])
    shown["names"] = "hidden: `gpushared status` on the node, or metrics.podNames: true"
    return shown


class _Unnamed:
    """The registry's families without the named ones, for ``generate_latest``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return (family for family in self.registry.collect() if family.name not in NAMED_FAMILIES)


class _Bounded(socketserver.ThreadingMixIn):
    """At most ``MAX_CONNECTIONS`` handler threads; a connection past them is closed as it is accepted."""

    daemon_threads = True
    block_on_close = False
    #: the kernel's queue of connections not yet accepted (socketserver's default is 5)
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._wake_read, self._wake_write = os.pipe()
        super().__init__(*args, **kwargs)

    def serve_until_stopped(self) -> None:
        """Accept until :meth:`stop`. socketserver's ``serve_forever`` wakes every half second to look for a
        shutdown (two listeners: four wake-ups a second, 0.03 % of an idle daemon's core); this blocks in
        the selector until a connection comes or :meth:`stop` writes to its pipe."""
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)  # type: ignore[arg-type]
            selector.register(self._wake_read, selectors.EVENT_READ)
            while True:
                ready = selector.select()
                if any(key.fd == self._wake_read for key, _ in ready):
                    return
                self._handle_request_noblock()  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Make :meth:`serve_until_stopped` return (from any thread)."""
        os.write(self._wake_write, b"x")

    def close(self) -> None:
        """Once it has returned: the listening socket and the pipe."""
        self.server_close()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _TcpServer(_Bounded, ThreadingHTTPServer):
    pass


class _Tcp6Server(_TcpServer):
    """An IPv6 listen address (``::`` also takes IPv4 where the kernel's bindv6only is off, its default)."""

    address_family = socket.AF_INET6


class _UnixServer(_Bounded, socketserver.UnixStreamServer):
    pass


def _handler(registry: CollectorRegistry, status: Callable[[], dict[str, Any]], *, names: bool) -> type:
    exposed: Any = registry if names else _Unnamed(registry)

    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_SECONDS

        def setup(self) -> None:
            super().setup()
            self._deadline = threading.Timer(REQUEST_SECONDS, self._cut)
            self._deadline.daemon = True
            self._deadline.start()

        def finish(self) -> None:
            self._deadline.cancel()
            with contextlib.suppress(OSError):
                super().finish()

        def _cut(self) -> None:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def address_string(self) -> str:
            return str(self.client_address[0]) if isinstance(self.client_address, tuple) else "local"

        def do_GET(self) -> None:
            if self.path == "/metrics":
                body, kind = generate_latest(exposed), CONTENT_TYPE_LATEST
            elif self.path == "/status":
                shown = status() if names else anonymous(status())
                body, kind = json.dumps(shown).encode(), "application/json"
            elif self.path == "/healthz":
                body, kind = b"ok\n", "text/plain"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class Endpoints:
    """Answering on ``address``:``port`` (``port`` 0: not at all) and on the socket ``local`` from the
    moment it is made; ``close`` stops both."""

    def __init__(
        self,
        address: str,
        port: int,
        *,
        registry: CollectorRegistry,
        status: Callable[[], dict[str, Any]],
        pod_names: bool = False,
        local: Path | None = None,
    ) -> None:
        servers: list[_Bounded] = []
        if port:
            server_class = _Tcp6Server if ":" in address else _TcpServer
            servers.append(server_class((address, port), _handler(registry, status, names=pod_names)))
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                local.unlink()  # left by a daemon that was killed
            umask = os.umask(0o177)  # created 0600: root only
            try:
                servers.append(_UnixServer(str(local), _handler(registry, status, names=True)))
            finally:
                os.umask(umask)
        self.servers = servers
        self.local = local
        self._threads = [
            threading.Thread(target=server.serve_until_stopped, name="http", daemon=True) for server in servers
        ]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        for server, thread in zip(self.servers, self._threads, strict=True):
            server.stop()
            thread.join(timeout=5)
            server.close()
        if self.local is not None:
            with contextlib.suppress(FileNotFoundError):
                self.local.unlink()


def get_local(path: Path, target: str, *, timeout: float = 5.0) -> bytes:
    """GET ``target`` from the local socket (``gpushared status``)."""
    import http.client

    class Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(str(path))

    connection = Connection("localhost", timeout=timeout)
    try:
        connection.request("GET", target)
        response = connection.getresponse()
        if response.status != 200:
            raise OSError(f"{path}: {target} answered {response.status}")
        return response.read()
    finally:
        connection.close()
