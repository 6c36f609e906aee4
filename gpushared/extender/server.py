"""The extender's HTTP service: one port, HTTP/1.1 on aiohttp and HTTP/2 (``http2.py``), both answered by
``routes.py``; readiness, metrics and the background work the app keeps running.

kube-scheduler calls filter, prioritize and bind with a short timeout (5 s by default). Everything runs on
the event loop, with no thread hand-off: filter and prioritize are lookups in the cache (a millisecond at
5,000 candidates), and bind's one API call is awaited, so the next filter is served while a bind waits for
the API server. A body larger than the limit or slower than the read timeout is refused, and the verbs
answer 503 until the cache has synced after a start — a filter from an empty cache would send pods to
nodes whose GPUs are already taken.

Over TLS the client picks the HTTP version in the handshake (ALPN): kube-scheduler's extender client offers
``h2`` and then carries every call on one connection; without TLS it is HTTP/1.1 (Go's client does not
speak cleartext HTTP/2 unless told to).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from gpushared.extender.config import ServerConfig
from gpushared.extender.http2 import Http2Protocol
from gpushared.extender.metrics import Metrics
from gpushared.extender.priming import Primer
from gpushared.extender.routes import FORWARDED, BodyTooLarge, Call, Leader, Ready, Routes
from gpushared.extender.scheduler import Scheduler

log = logging.getLogger(__name__)

#: The app's :class:`Metrics` and :class:`Routes`, for :func:`serve` (connections, HTTP/2).
METRICS = web.AppKey("metrics", Metrics)
ROUTES = web.AppKey("routes", Routes)
#: What the extender offers in the TLS handshake, preferred first.
ALPN = ("h2", "http/1.1")
#: A loop that has not run its 20 ms timer for this long is wedged: its Lease is not renewed (a third of
#: the renew deadline, so a follower takes over within one lease duration of the wedge).
LOOP_ALIVE_SECONDS = 3.0


class Heartbeat:
    """When the event loop last ran a timer. The verbs, the probes and the Lease all depend on the loop: a
    leader renews its Lease only while this is recent (a loop wedged by a deadlock once kept renewing from
    its election thread, and the follower forwarded every verb to it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()

    def beat(self) -> None:
        self.last = self.clock()

    def alive(self, within: float = LOOP_ALIVE_SECONDS) -> bool:
        return self.clock() - self.last < within


def build_app(
    scheduler: Scheduler,
    config: ServerConfig,
    *,
    ready: Ready,
    leader: Leader = lambda: None,
    metrics: Metrics | None = None,
    primer: Primer | None = None,
    heartbeat: Heartbeat | None = None,
) -> web.Application:
    """The aiohttp application: every path goes to :meth:`Routes.answer`, which HTTP/2 calls too; with a
    ``primer``, the pending pods' sizes are priced between the verbs (``priming``)."""
    metrics = metrics or Metrics()
    cache = scheduler.cache

    def ready_and_fresh() -> tuple[bool, str]:
        """Synced, and no watch known to be behind: a stale cache would place pods on GPUs already taken."""
        ok, why = ready()
        if not ok:
            return ok, why
        stale = cache.stale()
        return (False, f"the cache is stale: {stale}") if stale else (True, "")

    metrics.stale.set_function(lambda: 1.0 if cache.stale() else 0.0)
    metrics.unconfirmed.set_function(cache.unconfirmed)
    metrics.in_doubt.set_function(cache.reservations.in_doubt)
    metrics.allocation_edits.set_function(functools.partial(getattr, cache, "allocation_edits"))
    metrics.unreadable_pods.set_function(functools.partial(getattr, cache, "unreadable_pods"))
    metrics.watch_restarts.informers = [cache.nodes, cache.pods]
    metrics.leader.set_function(lambda: 1.0 if leader() is None else 0.0)
    routes = Routes(scheduler, config, ready=ready_and_fresh, leader=leader, metrics=metrics)

    async def http1(request: web.Request) -> web.Response:
        async def read() -> bytes:
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise BodyTooLarge from None

        transport = request.transport
        call = Call(
            method=request.method,
            path=request.path,
            read=read,
            ssl_object=transport.get_extra_info("ssl_object") if transport is not None else None,
            remote=request.remote,
            forwarded=bool(request.headers.get(FORWARDED)),
        )
        answer = await routes.answer(call)
        return web.Response(body=answer.body, status=answer.status, headers={"Content-Type": answer.content_type})

    app = web.Application(client_max_size=config.max_body_bytes)
    app[METRICS] = metrics
    app[ROUTES] = routes
    app.router.add_route("*", "/{path:.*}", http1)

    async def close(app: web.Application) -> None:
        await routes.close()

    app.on_cleanup.append(close)
    app.cleanup_ctx.append(_settling(scheduler))
    app.cleanup_ctx.append(_watching_the_loop(metrics, ready, heartbeat or Heartbeat()))
    if primer is not None:
        metrics.primed.primer = primer
        app.cleanup_ctx.append(_in_background("prime", primer.run))
    return app


#: How often the loop-lag probe asks to run; how late it runs is how long something held the loop.
LAG_PROBE_SECONDS = 0.02
#: How often the extender reads back binds the watch has not confirmed (``Scheduler.settle_binds``).
SETTLE_SECONDS = 1.0


def _in_background(name: str, work: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[web.Application], Any]:
    """``work`` as a task for as long as the app runs (an aiohttp cleanup context)."""

    async def context(app: web.Application) -> Any:
        task = asyncio.get_running_loop().create_task(work(), name=name)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return context


def _settling(scheduler: Scheduler) -> Callable[[web.Application], Any]:
    async def settle_forever() -> None:
        while True:
            try:
                await scheduler.settle_binds()
            except Exception:  # one bad round must not end the reads that release memory
                log.exception("reading binds back failed")
            await asyncio.sleep(SETTLE_SECONDS)

    return _in_background("settle-binds", settle_forever)


def _watching_the_loop(metrics: Metrics, ready: Ready, heartbeat: Heartbeat) -> Callable[[web.Application], Any]:
    """The loop's heartbeat, and the longest the loop was late to a timer, counted from the first time the
    extender is ready: the first sync holds the interpreter on purpose."""

    async def probe_forever() -> None:
        worst = 0.0
        clock = asyncio.get_running_loop().time
        while not ready()[0]:
            heartbeat.beat()
            await asyncio.sleep(LAG_PROBE_SECONDS)
        while True:
            heartbeat.beat()
            asked = clock()
            await asyncio.sleep(LAG_PROBE_SECONDS)
            lag = clock() - asked - LAG_PROBE_SECONDS
            if lag > worst:
                worst = lag
                metrics.loop_lag.set(worst)

    return _in_background("loop-lag", probe_forever)


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    if config.tls_cert is None and config.tls_key is None:
        if config.client_ca is not None:
            raise ValueError("client certificates need TLS: give a certificate and a key too")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ValueError("TLS needs both a certificate and a key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    context.set_alpn_protocols(ALPN)
    # A connection's client certificate is checked once (routes.certificate_names): no renegotiation
    # may present another one later. (TLS 1.3 has none; this closes TLS 1.2's.)
    context.options |= ssl.OP_NO_RENEGOTIATION
    if config.client_ca is not None:
        # Optional at the handshake, so kubelet's probes reach /healthz and /readyz; a certificate that is
        # presented must verify, and the verbs refuse a caller without one (_Routes._unauthenticated).
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cafile=str(config.client_ca))
    return context


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


async def serve(app: web.Application, config: ServerConfig, *, stop: asyncio.Event) -> None:
    """Serve ``app`` until ``stop``. The listening socket is opened here rather than by aiohttp's TCPSite, to
    pick the HTTP version per connection and count the connections (``gpushared_extender_connections``)."""
    runner = web.AppRunner(app, keepalive_timeout=config.keepalive_timeout, access_log=None)
    await runner.setup()
    http1, connections, routes = runner.server, app[METRICS].connections, app[ROUTES]
    assert http1 is not None  # set up above
    http2s: set[Http2Protocol] = set()

    def http2() -> Http2Protocol:
        return Http2Protocol(routes, config, live=http2s)

    context = tls_context(config)
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
    try:
        await stop.wait()
    finally:
        listening.close()  # no new connections; the open ones end with the runner, HTTP/2's with a GOAWAY
        await asyncio.gather(*(connection.drain(config.read_timeout) for connection in list(http2s)))
        await runner.cleanup()
        await listening.wait_closed()
