"""HTTP/2 on the extender's port, for clients that choose ``h2`` in the TLS handshake.

Why: kube-scheduler's extender client (client-go's transport defaults) offers h2 over TLS. Over HTTP/1.1 it
keeps two idle connections, so every call made beside another one in flight opens a new connection, a
mutual TLS handshake on both sides: 340-520 per 1,000 pods, most of what the extender cost kube-scheduler
(docs/benchmarks.md, "The scheduler with the extender"). Over h2 every call is a stream on one connection,
handshaken once.

This protocol only speaks HTTP/2 (framing, flow control, the limits below; the ``h2`` library holds the
state machine); what a request is answered is its ``Answering``'s (``extender.routes``), as over
HTTP/1.1. The limits a caller meets, as on HTTP/1.1: a body past ``max_body_bytes`` is 413 and a body slower than
``read_timeout`` is 408 (both in ``guard.Guard``), headers past :data:`MAX_HEADER_LIST_BYTES` and any
frame that breaks the protocol end the connection with a GOAWAY naming the error, a connection with no
request open for ``keepalive_timeout`` is closed, and at most :data:`MAX_STREAMS` answers are worked on per
connection — counting those of streams the client already reset, so opening and resetting streams as
fast as it can (the "rapid reset" attack, CVE-2023-44487) buys a client no more work than it could get
by waiting for its answers. A client that does not read is not read from (``pause_writing``).

A stream the client resets is not cancelled: a bind already sent to the API server finishes and is
counted, as over HTTP/1.1 when a client hangs up; only its answer is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from typing import cast

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from gpushared.extender.http.calls import TEXT, Answer, Answering, BodyTooLarge, Call
from gpushared.extender.http.config import ServerConfig

log = logging.getLogger(__name__)

#: Streams a client may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS), and answers in the works per
#: connection; kube-scheduler has at most a few calls in flight (a filter, binds).
MAX_STREAMS = 100
#: How much of a request body a client may send before the extender has read it, per stream and per
#: connection. 1 MiB holds the filter arguments of 5,000 candidate names in one round trip.
STREAM_WINDOW = 1 << 20
CONNECTION_WINDOW = 16 << 20
#: SETTINGS_MAX_HEADER_LIST_SIZE: what aiohttp allows a request's headers on HTTP/1.1, about.
MAX_HEADER_LIST_BYTES = 16 << 10


class _Stream:
    """One request's body as it arrives; ``body`` resolves when it is whole (or will never be)."""

    __slots__ = ("body", "chunks", "ended", "limit", "size", "too_large")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.body: asyncio.Future[bytes] = loop.create_future()
        self.chunks: list[bytes] = []
        self.size = 0
        #: the client sent END_STREAM: nothing more will arrive
        self.ended = False
        self.too_large = False
        #: the most of a body read on its path (``ServerConfig.body_limit``)
        self.limit = limit

    def wake(self, body: bytes = b"") -> None:
        if not self.body.done():
            self.body.set_result(body)

    async def read(self) -> bytes:
        body = await self.body
        if self.too_large:
            raise BodyTooLarge
        return body


class Http2Protocol(asyncio.Protocol):
    """One HTTP/2 connection. ``live`` holds the open ones, for the server to send away when it stops."""

    def __init__(self, routes: Answering, config: ServerConfig, *, live: set[Http2Protocol]) -> None:
        self.routes = routes
        self.config = config
        self.live = live
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=True)
        )
        #: requests not yet answered, by stream id
        self.streams: dict[int, _Stream] = {}
        #: answers being worked on, those of streams reset meanwhile included (the rapid-reset bound)
        self.tasks: set[asyncio.Task[None]] = set()
        #: answers waiting for the client to open its flow-control window (stream id, 0: any)
        self.window_waiters: dict[int, asyncio.Future[None]] = {}
        self.writable: asyncio.Future[None] | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.ssl_object = None
        self.remote: str | None = None
        #: the server is stopping: new streams are refused, the open ones answered, then a GOAWAY
        self.draining = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TLS transport is one, not by class
        self.ssl_object = transport.get_extra_info("ssl_object")
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else None
        self.live.add(self)
        conn = self.conn
        conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
            },
        )
        # Settings given this way are in force at once, without waiting for the client's ACK; h2 applies
        # the header-list size to its decoder only on an ACK of a change, so it is set there too.
        conn.decoder.max_header_list_size = MAX_HEADER_LIST_BYTES
        conn.initiate_connection()
        conn.increment_flow_control_window(CONNECTION_WINDOW - 65_535)  # from the protocol's initial window
        self._flush()
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # h2 has queued a GOAWAY naming the error
            log.warning("HTTP/2 connection from %s ended: %s", self.remote, exc or type(exc).__name__)
            self._flush()
            self._close()
            return
        if self._oversized_frame_pending():
            log.warning("HTTP/2 connection from %s ended: a frame past SETTINGS_MAX_FRAME_SIZE", self.remote)
            self.conn.close_connection(ErrorCodes.FRAME_SIZE_ERROR)
            self._flush()
            self._close()
            return
        # Streams the client opened and reset in this same read: no work is started for them at all.
        reset = {e.stream_id for e in events if isinstance(e, h2.events.StreamReset)}
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                if event.stream_id not in reset:
                    self._request(event)
            elif isinstance(event, h2.events.DataReceived):
                self._data(event)
            elif isinstance(event, h2.events.StreamEnded):
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.ended = True
                    stream.wake(b"".join(stream.chunks))
                    stream.chunks = []
            elif isinstance(event, h2.events.StreamReset):
                stream = self.streams.pop(event.stream_id, None)
                if stream is not None:
                    stream.wake()
                self._open_windows(event.stream_id)
            elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self._open_windows(getattr(event, "stream_id", 0))
            elif isinstance(event, h2.events.ConnectionTerminated):  # the client's GOAWAY
                if event.error_code != ErrorCodes.NO_ERROR:
                    log.warning("HTTP/2 client %s ended the connection: %s", self.remote, event.error_code)
                self._flush()
                self._close()
                return
        self._flush()
        self._arm_idle()

    def _oversized_frame_pending(self) -> bool:
        """Whether the frame h2 is still reading declared a length past SETTINGS_MAX_FRAME_SIZE.

        h2 checks a frame's length only once the whole frame has arrived, so a client that announces a
        16 MiB frame would have the extender buffer 16 MiB before being refused. What h2 holds after a
        read is at most one incomplete frame; its 9-byte header says how long it will be."""
        buffer = self.conn.incoming_buffer  # h2 has no public accessor for what it holds: "_data" since
        # h2 4.3, "data" before (an empty buffer is falsy either way, and has no frame to judge)
        pending: bytes | bytearray = getattr(buffer, "_data", b"") or getattr(buffer, "data", b"")
        return len(pending) >= 9 and int.from_bytes(pending[:3], "big") > self.conn.max_inbound_frame_size

    def pause_writing(self) -> None:
        """The client is not reading what it is sent. Stop reading from it too: what it sends may ask for
        answers of its own (PING and SETTINGS acknowledgements, RST_STREAM), and a client that floods
        them without reading would have them pile up here without bound (CVE-2019-9512, -9515)."""
        if self.writable is None:
            self.writable = self.loop.create_future()
            if self.transport is not None:
                self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set_result(None)
            self.writable = None
            if self.transport is not None:
                self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.live.discard(self)
        if self.idle is not None:
            self.idle.cancel()
        for stream in self.streams.values():
            stream.wake()
        self.streams.clear()
        self._open_windows(0)
        self.resume_writing()

    # requests

    def _request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        if self.draining or len(self.tasks) >= MAX_STREAMS:
            # Stopping, or a client that resets streams before their answers: a refused stream is one it
            # may send again (RFC 9113, 8.7), and no work was started for it.
            with contextlib.suppress(h2.exceptions.StreamClosedError):  # it was closed in the same read
                self.conn.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        headers = dict(event.headers or ())
        target = headers.get(b":path", b"").decode("utf-8", "replace")
        path = urllib.parse.unquote(target.partition("?")[0])  # decoded, as aiohttp's request.path is
        stream, length = _Stream(self.loop, self.config.body_limit(path)), headers.get(b"content-length", b"")
        # More digits than any body could need is too large too (and past 4,300 int() would raise).
        if length.isdigit() and (len(length) > 18 or int(length) > stream.limit):
            stream.too_large = True
            stream.wake()
        self.streams[sid] = stream
        call = Call(
            method=headers.get(b":method", b"").decode("ascii", "replace"),
            path=path,
            read=stream.read,
            ssl_object=self.ssl_object,
            remote=self.remote,
            forwarded=bool(headers.get(b"x-gpushared-forwarded")),
        )
        self.tasks.add(self.loop.create_task(self._respond(sid, stream, call)))

    def _data(self, event: h2.events.DataReceived) -> None:
        self.conn.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
        stream = self.streams.get(event.stream_id)
        if stream is None or stream.body.done():
            return  # answered or refused already: the window is given back, the bytes dropped
        data = event.data or b""
        stream.size += len(data)
        if stream.size > stream.limit:
            stream.too_large = True
            stream.chunks = []
            stream.wake()
        else:
            stream.chunks.append(data)

    async def _respond(self, sid: int, stream: _Stream, call: Call) -> None:
        try:
            await self._answer(sid, stream, call)
        finally:
            # Out of the count in the same step that wrote the answer, not a loop turn later (as a done
            # callback would be): a client that has its answer may open its next stream at once, and must
            # not find this one still counted against MAX_STREAMS.
            self.tasks.discard(cast("asyncio.Task[None]", asyncio.current_task()))

    async def _answer(self, sid: int, stream: _Stream, call: Call) -> None:
        try:
            answer = await self.routes.answer(call)
        except Exception:  # a bug: the routes answer every caller's fault themselves
            log.exception("%s %s failed", call.method, call.path)
            answer = Answer(500, b"500: internal error; see the log", TEXT)
        if self.streams.get(sid) is not stream:
            return  # reset by the client, or the connection is gone
        try:
            self.conn.send_headers(
                sid,
                [
                    (b":status", b"%d" % answer.status),
                    (b"content-type", answer.content_type.encode()),
                    (b"content-length", b"%d" % len(answer.body)),
                ],
                end_stream=not answer.body,
            )
            await self._send(sid, answer.body)
            if not stream.ended and self.streams.get(sid) is stream:
                # Answered before the body was whole (refused, too large, too slow): the rest is not wanted.
                self.conn.reset_stream(sid, ErrorCodes.NO_ERROR)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass  # reset by the client while the answer was going out, or the connection ended
        finally:
            if self.streams.get(sid) is stream:
                del self.streams[sid]
            self._flush()
            self._arm_idle()

    async def _send(self, sid: int, body: bytes) -> None:
        """``body`` as DATA frames, as fast as the client's flow-control windows and the socket allow. A
        client that opens no window for ``read_timeout`` gets the stream reset (CANCEL); one that leaves
        the socket full that long loses the connection: an answer nobody reads holds nothing for good."""
        offset = 0
        while offset < len(body):
            if self.transport is None:
                return
            window = self.conn.local_flow_control_window(sid)
            if window <= 0:
                waiter = self.window_waiters.get(sid)
                if waiter is None:
                    waiter = self.window_waiters[sid] = self.loop.create_future()
                if not await self._within_timeout(waiter):
                    self.window_waiters.pop(sid, None)
                    log.warning("HTTP/2 client %s opened no window for its answer: stream reset", self.remote)
                    self.conn.reset_stream(sid, ErrorCodes.CANCEL)
                    return
                continue
            size = min(window, self.conn.max_outbound_frame_size, len(body) - offset)
            self.conn.send_data(sid, body[offset : offset + size], end_stream=offset + size == len(body))
            offset += size
            self._flush()
            if self.writable is not None and not await self._within_timeout(self.writable):
                log.warning("HTTP/2 client %s reads nothing it is sent: connection closed", self.remote)
                if self.transport is not None:
                    self.transport.abort()
                return

    async def _within_timeout(self, event: asyncio.Future[None]) -> bool:
        """Whether ``event`` happened within ``read_timeout`` (shared futures are never cancelled here)."""
        try:
            async with asyncio.timeout(self.config.read_timeout):
                await asyncio.shield(event)
        except TimeoutError:
            return False
        return True

    def _open_windows(self, sid: int) -> None:
        """Wake the answers waiting for window: one stream's, or (0: the connection's or every setting) all."""
        for waiting in [sid] if sid else list(self.window_waiters):
            waiter = self.window_waiters.pop(waiting, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    # the connection

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None:
            self.transport.write(data)

    def _arm_idle(self) -> None:
        """Close the connection ``keepalive_timeout`` after its last request closed. The clock starts when
        the connection falls idle and stops while a request is open; nothing else (pings, settings,
        window updates) moves it."""
        if self.streams or self.transport is None:
            if self.idle is not None:
                self.idle.cancel()
                self.idle = None
        elif self.idle is None:
            self.idle = self.loop.call_later(self.config.keepalive_timeout, self.shut)

    async def drain(self, timeout: float) -> None:
        """For a server that stops: the answers being worked on are sent (for up to ``timeout``), new
        streams refused meanwhile, then :meth:`shut`. (After its GOAWAY h2 sends nothing more.)"""
        self.draining = True
        pending = [task for task in self.tasks if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        self.shut()

    def shut(self) -> None:
        """A GOAWAY, then the connection closes: the client sends what it had not yet sent on a new one.
        Answers still being worked on finish (a bind is not cut in half); theirs are not sent."""
        if self.transport is None:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):  # already closed
            self.conn.close_connection(ErrorCodes.NO_ERROR)
        self._flush()
        self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
