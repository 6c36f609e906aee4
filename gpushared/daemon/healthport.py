"""``/healthz`` on a port of its own, which strangers cannot starve.

The metrics port serves 16 connections at once, a thread each, and closes the rest as it accepts them: a
client that held 32 connections and reconnected whenever one was closed made the kubelet's probes fail 30
times out of 30, and the chart's liveness probe would have restarted the daemon in a loop. This listener
needs no thread per connection: one thread and a selector serve up to ``CAPACITY`` connections, each
closed ``DEADLINE_SECONDS`` after it was accepted, and a new connection past the capacity closes the
*oldest* one instead of itself. A probe connects and sends its request at once, so holders would have to
open ``CAPACITY`` connections between its connect and its request to push it out; the answer is a few
bytes written in the same turn. It answers ``/healthz`` and nothing else: no names, no metrics.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Final

#: Connections held at once; a new one past this closes the oldest.
CAPACITY: Final = 512
#: A connection is closed this long after it was accepted, answered or not.
DEADLINE_SECONDS: Final = 2.0
#: The most of a request read: a probe's request line and headers are some hundred bytes.
MAX_REQUEST_BYTES: Final = 4096

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def answer(request: bytes) -> bytes | None:
    """The response to what a connection sent so far; None while its headers are not all in."""
    if b"\r\n\r\n" not in request and b"\n\n" not in request:
        return _BAD if len(request) >= MAX_REQUEST_BYTES else None
    parts = request.split(b"\n", 1)[0].strip().split(b" ")
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD") or not parts[2].startswith(b"HTTP/1."):
        return _BAD
    if parts[1].split(b"?", 1)[0] != b"/healthz":
        return _NOT_FOUND
    return _OK if parts[0] == b"GET" else _OK[: _OK.index(b"\r\n\r\n") + 4]


class HealthListener:
    """Serving on ``address``:``port`` from the moment it is made (port 0: an ephemeral one, in
    :attr:`port`); :meth:`close` stops it."""

    def __init__(self, address: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((address, port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        #: connection -> (accepted at, what it sent so far), oldest first
        self._open: OrderedDict[socket.socket, tuple[float, bytes]] = OrderedDict()
        self._wake_read, self._wake_write = os.pipe()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="healthz", daemon=True)
        self._thread.start()

    def close(self) -> None:
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        for connection in list(self._open):
            self._drop(connection)
        self._selector.close()
        self._listener.close()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def _serve(self) -> None:
        while True:
            now = time.monotonic()
            timeout = None
            if self._open:
                oldest = next(iter(self._open.values()))[0]
                timeout = max(0.0, oldest + DEADLINE_SECONDS - now)
            for key, _ in self._selector.select(timeout):
                if key.fileobj == self._wake_read:
                    return
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            self._expire(time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE and friends: make room, try at the next turn
                if self._open:
                    self._drop(next(iter(self._open)))
                return
            if len(self._open) >= CAPACITY:
                self._drop(next(iter(self._open)))  # the oldest makes room, not the newcomer
            connection.setblocking(False)
            self._open[connection] = (time.monotonic(), b"")
            self._selector.register(connection, selectors.EVENT_READ)

    def _read(self, connection: socket.socket) -> None:
        accepted, sent = self._open.get(connection, (0.0, b""))
        try:
            chunk = connection.recv(MAX_REQUEST_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(connection)
            return
        sent = (sent + chunk)[:MAX_REQUEST_BYTES]
        response = answer(sent)
        if response is None:
            self._open[connection] = (accepted, sent)
            return
        with contextlib.suppress(OSError):
            connection.send(response)  # some bytes: the socket's buffer takes them whole
        self._drop(connection)

    def _expire(self, now: float) -> None:
        while self._open:
            connection, (accepted, _) = next(iter(self._open.items()))
            if now < accepted + DEADLINE_SECONDS:
                return
            self._drop(connection)

    def _drop(self, connection: socket.socket) -> None:
        self._open.pop(connection, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(connection)
        connection.close()
