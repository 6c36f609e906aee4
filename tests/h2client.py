"""A small blocking HTTP/2 client for the tests: several streams at once, resets, raw bytes, and what the
server said on each stream (headers, body, reset) and to the connection (GOAWAY)."""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings


@dataclass
class Response:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: the server's RST_STREAM error code, if it reset the stream
    reset: int | None = None
    ended: bool = False

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None


class H2Client:
    """One connection: TLS with ALPN ``h2`` (given ``ca``), else HTTP/2 with prior knowledge on plain TCP."""

    def __init__(
        self,
        port: int,
        *,
        ca: Path | None = None,
        client: tuple[Path, Path] | None = None,
        window: int | None = None,
        timeout: float = 10.0,
    ) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.alpn: str | None = None
        if ca is not None:
            context = ssl.create_default_context(cafile=str(ca))
            context.check_hostname = False
            context.set_alpn_protocols(["h2", "http/1.1"])
            if client is not None:
                context.load_cert_chain(str(client[0]), str(client[1]))
            sock = context.wrap_socket(sock)
            self.alpn = sock.selected_alpn_protocol()
        self.sock = sock
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        if window is not None:  # a client that reads answers slowly (or takes them as fast as they come)
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
            if window > 65_535:
                self.conn.increment_flow_control_window(window - 65_535)
        self.responses: dict[int, Response] = {}
        #: the server's GOAWAY error code, once it sent one
        self.goaway: int | None = None
        self.closed = False
        #: the server's settings as it announced them
        self.settings: dict[int, int] = {}
        self.flush()
        deadline = time.monotonic() + timeout
        while not self.settings and not self.closed and time.monotonic() < deadline:
            self.pump()  # the server's SETTINGS (its windows, its limits) before any request

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        end: bool = True,
        headers: dict[str, str] | None = None,
    ) -> int:
        """Start a request; ``end=False`` leaves its body open for :meth:`send`."""
        sid = self.conn.get_next_available_stream_id()
        fields = [(":method", method), (":path", path), (":scheme", "https"), (":authority", "extender")]
        fields += list((headers or {}).items())
        self.conn.send_headers(sid, fields, end_stream=end and not body)
        self.responses[sid] = Response()
        if body:
            self.send(sid, body, end=end)
        self.flush()
        return sid

    def send(self, sid: int, data: bytes, *, end: bool = False) -> None:
        """Body bytes, waiting for the server's windows to open where they must."""
        for offset in range(0, max(len(data), 1), 16_384):
            chunk = data[offset : offset + 16_384]
            last = offset + 16_384 >= len(data)
            deadline = time.monotonic() + 10
            while self.conn.local_flow_control_window(sid) < len(chunk) and time.monotonic() < deadline:
                self.pump()
            self.conn.send_data(sid, chunk, end_stream=end and last)
            self.flush()

    def reset(self, sid: int) -> None:
        self.conn.reset_stream(sid)
        self.flush()

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def pump(self, timeout: float = 0.2) -> None:
        """Read what the server sent within ``timeout`` and file it."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except (TimeoutError, BlockingIOError, ssl.SSLWantReadError):
            return
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.conn.receive_data(data):
            response = self.responses.get(getattr(event, "stream_id", 0))
            if isinstance(event, h2.events.ResponseReceived) and response is not None:
                response.headers = dict(event.headers)  # type: ignore[arg-type]
                response.status = int(response.headers[":status"])
            elif isinstance(event, h2.events.DataReceived) and response is not None:
                response.body += event.data or b""
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded) and response is not None:
                response.ended = True
            elif isinstance(event, h2.events.StreamReset) and response is not None:
                response.reset = int(event.error_code or 0)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway = int(event.error_code or 0)
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self.settings.update({int(k): v.new_value for k, v in event.changed_settings.items()})
        self.flush()

    def wait(self, *sids: int, timeout: float = 10.0) -> list[Response]:
        """Until each stream is answered or reset (or the connection ends)."""
        deadline = time.monotonic() + timeout
        while not all(self.responses[s].done for s in sids) and not self.closed and self.goaway is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"streams {sids} not answered in {timeout} s: {self.responses}")
            self.pump()
        return [self.responses[s] for s in sids]

    def request(self, method: str, path: str, body: bytes | None = None, **kwargs: object) -> Response:
        return self.wait(self.open(method, path, body, **kwargs))[0]  # type: ignore[arg-type]

    def wait_closed(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.closed:
            if time.monotonic() > deadline:
                raise TimeoutError("the server kept the connection open")
            self.pump()

    def close(self) -> None:
        self.sock.close()
