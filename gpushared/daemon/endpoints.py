"""The daemon's HTTP endpoints for people and Prometheus: ``/metrics``, ``/status`` (JSON) and ``/healthz``.

Read-only, on a thread of their own: nothing asked here changes the daemon or waits on its loop. The
kubelet speaks to the daemon over gRPC elsewhere (``gpushared.deviceplugin.server``).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def serve(
    address: str, port: int, *, registry: CollectorRegistry, status: Callable[[], dict[str, Any]]
) -> ThreadingHTTPServer:
    """Start answering on ``address``:``port`` (an IPv6 address takes ``::``-style listening); the caller
    stops the server it is given (``shutdown``, ``server_close``)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/metrics":
                body, kind = generate_latest(registry), CONTENT_TYPE_LATEST
            elif self.path == "/status":
                body, kind = json.dumps(status()).encode(), "application/json"
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

    server = (ThreadingHTTPServer6 if ":" in address else ThreadingHTTPServer)((address, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


class ThreadingHTTPServer6(ThreadingHTTPServer):
    """An IPv6 listen address (``::`` also takes IPv4 where the kernel's bindv6only is off, its default)."""

    address_family = socket.AF_INET6
