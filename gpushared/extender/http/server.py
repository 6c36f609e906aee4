"""The extender's port: one listening socket, HTTP/1.1 on aiohttp and HTTP/2 (``http2.py``) chosen per
connection, both handing each call to one :class:`calls.Answering` (``extender.routes``).

kube-scheduler calls filter, prioritize and bind with a short timeout (5 s by default). Everything runs on
the event loop, with no thread hand-off: filter and prioritize are lookups in the cache (a millisecond at
5,000 candidates), and bind's one API call is awaited, so the next filter is served while a bind waits for
the API server.

Over TLS the client picks the HTTP version in the handshake (ALPN): kube-scheduler's extender client offers
``h2`` and then carries every call on one connection; without TLS it is HTTP/1.1 (Go's client does not
speak cleartext HTTP/2 unless told to).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import Counter

from gpushared.extender.http.calls import Answering, BodyTooLarge, Call
from gpushared.extender.http.config import ServerConfig
from gpushared.extender.http.guard import FORWARDED
from gpushared.extender.http.http2 import Http2Protocol
from gpushared.extender.http.tls import ServingTls

log = logging.getLogger(__name__)


class _CallerFaults(logging.Filter):
    """aiohttp logs a request its parser refuses (a URL or header past 8 KiB, bytes that are not HTTP) as an
    ERROR with a traceback, once per request: anyone who reaches the port could flood the log. The caller
    gets its 400 all the same; the log gets a line at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        fault = record.exc_info[1] if record.exc_info else None
        if isinstance(fault, HttpProcessingError):
            log.debug("request refused by the HTTP parser: %s", str(fault).splitlines()[0][:200])
            return False
        return True


def application(answering: Answering, config: ServerConfig) -> web.Application:
    """The aiohttp application: every path and method goes to ``answering``, as over HTTP/2."""

    async def http1(request: web.Request) -> web.Response:
        limit = config.body_limit(request.path)

        async def read() -> bytes:
            if limit >= config.max_body_bytes:
                try:
                    return await request.read()
                except web.HTTPRequestEntityTooLarge:
                    raise BodyTooLarge from None
            # A route with a smaller limit than the app's: refused by its length, else at the first byte past it.
            if request.content_length is not None and request.content_length > limit:
                raise BodyTooLarge
            body = bytearray()
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise BodyTooLarge
            return bytes(body)

        transport = request.transport
        call = Call(
            method=request.method,
            path=request.path,
            read=read,
            ssl_object=transport.get_extra_info("ssl_object") if transport is not None else None,
            remote=request.remote,
            forwarded=bool(request.headers.get(FORWARDED)),
        )
        answer = await answering.answer(call)
        return web.Response(body=answer.body, status=answer.status, headers={"Content-Type": answer.content_type})

    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _CallerFaults) for f in server_log.filters):
        server_log.addFilter(_CallerFaults())
    app = web.Application(client_max_size=config.max_body_bytes)
    app.router.add_route("*", "/{path:.*}", http1)
    return app


class _ByAlpn(asyncio.Protocol):
    """Stands in for the connection's protocol until the TLS handshake is done, then hands the transport to
    the one the client chose in ALPN (no ALPN: HTTP/1.1) and steps aside."""

    def __init__(
        self,
        http1: Callable[[], asyncio.BaseProtocol],
        http2: Callable[[], asyncio.BaseProtocol],
        connections: Counter,
    ) -> None:
        self.http1, self.http2, self.connections = http1, http2, connections

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        chosen = (ssl_object.selected_alpn_protocol() if ssl_object is not None else None) or "http/1.1"
        protocol = self.http2() if chosen == "h2" else self.http1()
        self.connections.labels(protocol=chosen).inc()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)


async def serve(
    app: web.Application,
    answering: Answering,
    config: ServerConfig,
    *,
    tls: ServingTls,
    connections: Counter,
    stop: asyncio.Event,
) -> None:
    """Serve ``app`` (from :func:`application`, with whatever it runs in the background) until ``stop``.
    The listening socket is opened here rather than by aiohttp's TCPSite, to pick the HTTP version per
    connection and count the connections (``connections``, labelled by protocol); ``tls`` is read again
    while it serves (``tls.py``)."""
    runner = web.AppRunner(app, keepalive_timeout=config.keepalive_timeout, access_log=None)
    await runner.setup()
    http1, routes = runner.server, answering
    assert http1 is not None  # set up above
    http2s: set[Http2Protocol] = set()

    def http2() -> Http2Protocol:
        return Http2Protocol(routes, config, live=http2s)

    context = tls.listening
    if context is None:
        plain = connections.labels(protocol="http/1.1")

        def accepted() -> asyncio.BaseProtocol:
            plain.inc()
            return http1()

    else:

        def accepted() -> asyncio.BaseProtocol:
            return _ByAlpn(http1, http2, connections)

    loop = asyncio.get_running_loop()
    listening = await loop.create_server(
        accepted, config.address, config.port, ssl=context, backlog=512, reuse_address=True
    )
    log.info("extender listening on %s:%d%s", config.address, config.port, config.prefix)
    reloading = asyncio.create_task(tls.keep_fresh(stop), name="tls-reload") if context is not None else None
    try:
        await stop.wait()
    finally:
        if reloading is not None:
            await reloading
        listening.close()  # no new connections; the open ones end with the runner, HTTP/2's with a GOAWAY
        await asyncio.gather(*(connection.drain(config.read_timeout) for connection in list(http2s)))
        await runner.cleanup()
        await listening.wait_closed()
