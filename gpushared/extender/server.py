"""The extender's HTTP service on aiohttp: routes, limits, readiness, metrics.

kube-scheduler calls filter, prioritize and bind with a short timeout (5 s by default). Everything runs on
the event loop, with no thread hand-off: filter and prioritize are lookups in the cache (a millisecond at
5,000 candidates), and bind's one API call is awaited, so the next filter is served while a bind waits for
the API server. A body larger than the limit or slower than the read timeout is refused, and the verbs
answer 503 until the cache has synced after a start — a filter from an empty cache would send pods to
nodes whose GPUs are already taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import platform
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gpushared import __version__
from gpushared.core.admission import GPUSHARED_SCHEDULER, scheduler_route
from gpushared.core.bodies import meta_of
from gpushared.core.report import node_report
from gpushared.extender import wire
from gpushared.extender.scheduler import BindError, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    address: str = "0.0.0.0"
    port: int = 39999
    prefix: str = "/gpushare-scheduler"
    #: the body is parsed on the event loop; why 8 MiB: docs/benchmarks.md, "What a request may hold the
    #: event loop for"
    max_body_bytes: int = 8 * 2**20
    max_nodes: int = wire.MAX_NODES
    read_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: mutual TLS: the verbs answer only callers whose client certificate this CA signed
    client_ca: Path | None = None
    #: and, if any are given, whose certificate's common name or DNS name is one of these
    client_names: frozenset[str] = frozenset()
    #: /inspect names pods to callers without a client certificate too
    public_pod_names: bool = False
    #: where <prefix>/mutate sends new pods that ask for GPU memory (core/admission.py)
    webhook_scheduler: str = GPUSHARED_SCHEDULER


class WatchRestarts(Collector):
    """Watches listed again, per informer and reason: counts the informers keep, exposed as a counter."""

    def __init__(self) -> None:
        self.informers: list[Any] = []

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "gpushared_extender_watch_restarts",
            "Watches of the cache listed again because they went silent, or lagged behind a read-back",
            labels=("informer", "reason"),
        )
        for informer in self.informers:
            family.add_metric((informer.name, "silent"), informer.silent_watches)
            family.add_metric((informer.name, "lagging"), informer.lag_relists)
        yield family


class Metrics:
    """The extender's series; names as Prometheus's conventions want them (tests/unit/test_metric_names.py)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        Gauge(
            "gpushared_build_info",
            "Always 1; the labels say which gpushared this is",
            ("component", "version", "python"),
            registry=self.registry,
        ).labels(component="extender", version=__version__, python=platform.python_version()).set(1)
        self.leader = Gauge(
            "gpushared_extender_leader",
            "1 while this replica answers kube-scheduler itself (it holds the Lease, or runs without election)",
            registry=self.registry,
        )
        self.seconds = Histogram(
            "gpushared_extender_request_seconds",
            "Time to answer kube-scheduler, per verb",
            ("verb",),
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.errors = Counter(
            "gpushared_extender_errors", "Requests answered with an error, per verb", ("verb",), registry=self.registry
        )
        self.nodes = Gauge("gpushared_extender_nodes", "gpushared nodes in the cache", registry=self.registry)
        self.stale = Gauge(
            "gpushared_extender_cache_stale",
            "1 while a watch of the cache is silent past its bound or being listed again after it lagged",
            registry=self.registry,
        )
        self.watch_restarts = WatchRestarts()
        self.registry.register(self.watch_restarts)
        self.allocation_edits = Gauge(
            "gpushared_extender_allocation_edits",
            "Bound pods whose GPU annotations were edited to name other GPUs; the cache keeps their GPUs",
            registry=self.registry,
        )
        self.loop_lag = Gauge(
            "gpushared_extender_event_loop_lag_max_seconds",
            "The longest the event loop was late to a 20 ms timer since start: how long one request held it",
            registry=self.registry,
        )
        # kube-scheduler's extender client keeps two idle connections per extender (Go's default), so binds
        # in flight beside a filter open new ones, each a full (mutual) TLS handshake on both sides; the
        # rate this grows at is that churn (docs/benchmarks.md, "The scheduler with the extender").
        self.connections = Counter(
            "gpushared_extender_connections", "Connections accepted on the extender's port", registry=self.registry
        )
        self.unconfirmed = Gauge(
            "gpushared_extender_unconfirmed_binds",
            "Binds counted in the cache that neither the watch nor a read-back has confirmed yet",
            registry=self.registry,
        )


#: The app's :class:`Metrics`, for :func:`serve` to count connections in.
METRICS = web.AppKey("metrics", Metrics)

Ready = Callable[[], tuple[bool, str]]
#: None: serve the verbs here. A URL: the leader's, to forward them to. "": no leader known yet.
Leader = Callable[[], str | None]
FORWARDED = "X-Gpushared-Forwarded"


def build_app(
    scheduler: Scheduler,
    config: ServerConfig,
    *,
    ready: Ready,
    leader: Leader = lambda: None,
    metrics: Metrics | None = None,
) -> web.Application:
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
    metrics.allocation_edits.set_function(functools.partial(getattr, cache, "allocation_edits"))
    metrics.watch_restarts.informers = [cache.nodes, cache.pods]
    metrics.leader.set_function(lambda: 1.0 if leader() is None else 0.0)
    routes = _Routes(scheduler, config, ready=ready_and_fresh, leader=leader, metrics=metrics)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[METRICS] = metrics
    prefix = config.prefix.rstrip("/")
    app.router.add_post(f"{prefix}/filter", routes.verb("filter", routes.filter))
    app.router.add_post(f"{prefix}/prioritize", routes.verb("prioritize", routes.prioritize))
    app.router.add_post(f"{prefix}/prioritize-no-gpu", routes.verb("prioritize-no-gpu", routes.prioritize_no_gpu))
    app.router.add_post(f"{prefix}/bind", routes.verb("bind", routes.bind))
    app.router.add_post(f"{prefix}/mutate", routes.verb("mutate", routes.mutate, stateless=True))
    app.router.add_get(f"{prefix}/inspect", routes.inspect_all)
    app.router.add_get(f"{prefix}/inspect/{{node}}", routes.inspect_node)
    app.router.add_get("/healthz", routes.healthz)
    app.router.add_get("/readyz", routes.readyz)
    app.router.add_get("/metrics", routes.prometheus)
    app.router.add_get("/version", routes.version)
    app.on_cleanup.append(routes.close)
    app.cleanup_ctx.append(_settling(scheduler))
    app.cleanup_ctx.append(_watching_the_loop(metrics, ready))
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


def _watching_the_loop(metrics: Metrics, ready: Ready) -> Callable[[web.Application], Any]:
    """The longest the loop was late to a timer, counted from the first time the extender is ready: the
    first sync holds the interpreter on purpose."""

    async def probe_forever() -> None:
        worst = 0.0
        clock = asyncio.get_running_loop().time
        while not ready()[0]:
            await asyncio.sleep(LAG_PROBE_SECONDS)
        while True:
            asked = clock()
            await asyncio.sleep(LAG_PROBE_SECONDS)
            lag = clock() - asked - LAG_PROBE_SECONDS
            if lag > worst:
                worst = lag
                metrics.loop_lag.set(worst)

    return _in_background("loop-lag", probe_forever)


class _Routes:
    def __init__(
        self, scheduler: Scheduler, config: ServerConfig, *, ready: Ready, leader: Leader, metrics: Metrics
    ) -> None:
        self.scheduler = scheduler
        self.config = config
        self.ready = ready
        self.leader = leader
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    async def close(self, app: web.Application) -> None:
        await self.scheduler.close()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request, raw: bytes, leader: str) -> web.Response:
        """A follower passes the verb to the leader, so every replica can be Ready behind the Service."""
        if self._session is None:
            context = ssl.create_default_context(cafile=str(self.config.tls_cert)) if self.config.tls_cert else None
            if context is not None:
                # Replicas reach each other by pod IP, which their certificate does not name; the chain is
                # still verified against the certificate (self-signed) or the CA.
                context.check_hostname = False
            if context is not None and self.config.client_ca is not None:
                # The leader asks for a client certificate too: this replica presents its own.
                context.load_verify_locations(cafile=str(self.config.client_ca))
                context.load_cert_chain(str(self.config.tls_cert), str(self.config.tls_key))
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.read_timeout),
                connector=aiohttp.TCPConnector(ssl=context) if context else None,
            )
        try:
            async with self._session.post(
                leader + request.path, data=raw, headers={"Content-Type": "application/json", FORWARDED: "1"}
            ) as answer:
                return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _json({"Error": f"the leader at {leader} did not answer: {exc}"}, status=503)

    def verb(
        self, name: str, handler: Callable[[bytes], Awaitable[web.Response]], *, stateless: bool = False
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        """Readiness, body limits and timeouts, 400 for a malformed body, and the latency metric.

        A ``stateless`` verb answers from the request alone (the webhook): every replica serves it, synced
        or not, leader or not, and it asks for no client certificate."""

        seconds, errors = self.metrics.seconds.labels(verb=name), self.metrics.errors.labels(verb=name)  # once

        async def serve(request: web.Request) -> web.Response:
            started = time.perf_counter()
            try:
                refused = None if stateless else self._unauthenticated(request)
                if refused is not None:
                    errors.inc()
                    log.warning("%s from %s refused: %s", name, request.remote, refused[1])
                    return _json({"Error": refused[1]}, status=refused[0])
                ok, why = (True, "") if stateless else self.ready()
                if not ok:
                    errors.inc()
                    return _json({"Error": why}, status=503)
                try:
                    async with asyncio.timeout(self.config.read_timeout):  # no task per request, unlike wait_for
                        raw = await request.read()
                except web.HTTPRequestEntityTooLarge:
                    errors.inc()
                    return _json({"Error": f"{name}: body larger than {self.config.max_body_bytes} bytes"}, status=413)
                except TimeoutError:
                    errors.inc()
                    return _json({"Error": f"{name}: request body too slow"}, status=408)
                leader = None if stateless else self.leader()
                if leader is not None:
                    if request.headers.get(FORWARDED) or not leader:
                        errors.inc()
                        return _json({"Error": "this replica is not the leader, and no leader is known"}, status=503)
                    return await self._forward(request, raw, leader)
                try:
                    return await handler(raw)
                except wire.WireError as exc:
                    errors.inc()
                    return _json({"Error": str(exc)}, status=400)
                except Exception as exc:  # a bug, never a caller's fault: say so, keep serving
                    errors.inc()
                    log.exception("%s failed", name)
                    return _json({"Error": f"{name}: internal error ({type(exc).__name__}); see the log"}, status=500)
            finally:
                seconds.observe(time.perf_counter() - started)

        return serve

    def _unauthenticated(self, request: web.Request) -> tuple[int, str] | None:
        """The HTTP status and reason the caller may not use the verbs with (None: it may): 401 without a
        client certificate, 403 with one whose name is not allowed. Without --client-ca anyone may."""
        if self.config.client_ca is None:
            return None
        names = _certificate_names(request)
        if names is None:
            return 401, "a client certificate signed by the extender's client CA is required"
        if self.config.client_names and not names & self.config.client_names:
            return 403, f"client certificate {sorted(names)} is not allowed here"
        return None

    async def filter(self, raw: bytes) -> web.Response:
        args = wire.parse_args(raw, verb="filter", max_nodes=self.config.max_nodes)
        passed, failed, error = self.scheduler.filter(args)
        return _json(wire.filter_result(args, passed=passed, failed=failed, error=error))

    async def prioritize(self, raw: bytes) -> web.Response:
        args = wire.parse_args(raw, verb="prioritize", max_nodes=self.config.max_nodes)
        return _json(wire.priority_list(self.scheduler.prioritize(args)))

    async def prioritize_no_gpu(self, raw: bytes) -> web.Response:
        args = wire.parse_args(raw, verb="prioritize-no-gpu", max_nodes=self.config.max_nodes)
        return _json(wire.priority_list(self.scheduler.prioritize_no_gpu(args)))

    async def bind(self, raw: bytes) -> web.Response:
        args = wire.parse_binding(raw)
        try:
            await self.scheduler.bind(args)
        except BindError as exc:
            self.metrics.errors.labels(verb="bind").inc()
            log.warning("bind refused: %s", exc)
            return _json(wire.binding_result(str(exc)))
        return _json(wire.binding_result())

    async def mutate(self, raw: bytes) -> web.Response:
        """The mutating admission webhook: the API server calls it for every pod created in the namespaces
        its configuration selects. Stateless (``verb``): the answer depends on the pod alone. No client
        certificate is asked for, because the API server presents none unless configured to; a caller gets
        only a patch for the object it sent, and nothing changes here."""
        review = wire.parse_admission_review(raw)
        patch: tuple[dict[str, Any], ...] = ()
        if review.pod is not None and review.operation == "CREATE":
            route = scheduler_route(
                review.pod, scheduler=self.config.webhook_scheduler, resources=self.scheduler.resources
            )
            patch = route.patch
            if patch:
                meta = meta_of(review.pod)
                name = meta.get("name") or meta.get("generateName", "") + "*"
                log.info("new pod %s/%s %s", review.namespace, name, route.reason)
        return _json(wire.admission_response(review, patch))

    def _report(self, name: str, request: web.Request) -> dict[str, Any] | None:
        snapshot = self.scheduler.cache.snapshot(name)
        if snapshot is None:
            return None
        inventory, holdings, address = snapshot
        report = node_report(name=name, address=address, inventory=inventory, holdings=holdings)
        if not self._may_see_pods(request):
            _hide_pods(report)
        return report

    def _may_see_pods(self, request: web.Request) -> bool:
        """Pod names (and so which tenants run where) only to authenticated callers, unless the flag says."""
        if self.config.public_pod_names:
            return True
        return self.config.client_ca is not None and self._unauthenticated(request) is None

    async def inspect_all(self, request: web.Request) -> web.Response:
        nodes = [r for r in (self._report(n, request) for n in self.scheduler.cache.node_names()) if r is not None]
        self.metrics.nodes.set(len(nodes))
        return _json({"nodes": nodes})

    async def inspect_node(self, request: web.Request) -> web.Response:
        name = request.match_info["node"]
        found = self._report(name, request)
        if found is None:
            return _json(
                {"nodes": [], "error": f"node {name} is not a gpushared node known to the extender"}, status=404
            )
        return _json({"nodes": [found]})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        ok, why = self.ready()
        return web.Response(text=("ok" if ok else why) + "\n", status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return web.Response(text=__version__ + "\n")


def _hide_pods(report: dict[str, Any]) -> None:
    """Amounts stay (they are the node's state); who holds them goes."""
    for holder in [*(p for dev in report["devs"] for p in dev["pods"]), *report["pending"]]:
        holder["name"] = holder["namespace"] = HIDDEN


#: What an unauthenticated caller sees in place of a pod's name and namespace.
HIDDEN = "(hidden)"


def _certificate_names(request: web.Request) -> set[str] | None:
    """The common names and DNS names of the caller's verified client certificate; None without one."""
    ssl_object = request.transport.get_extra_info("ssl_object") if request.transport is not None else None
    certificate = ssl_object.getpeercert() if ssl_object is not None else None
    if not certificate:
        return None
    names = {value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"}
    names |= {value for kind, value in certificate.get("subjectAltName", ()) if kind == "DNS"}
    return names


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    if config.tls_cert is None and config.tls_key is None:
        if config.client_ca is not None:
            raise ValueError("client certificates need TLS: give a certificate and a key too")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ValueError("TLS needs both a certificate and a key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    if config.client_ca is not None:
        # Optional at the handshake, so kubelet's probes reach /healthz and /readyz; a certificate that is
        # presented must verify, and the verbs refuse a caller without one (_Routes._unauthenticated).
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cafile=str(config.client_ca))
    return context


async def serve(app: web.Application, config: ServerConfig, *, stop: asyncio.Event) -> None:
    """Serve ``app`` until ``stop``. The listening socket is opened here rather than by aiohttp's TCPSite, to
    count each connection it accepts (``gpushared_extender_connections``)."""
    runner = web.AppRunner(app, keepalive_timeout=config.keepalive_timeout, access_log=None)
    await runner.setup()
    handler, connections = runner.server, app[METRICS].connections
    assert handler is not None  # set up above

    def accepted() -> asyncio.Protocol:
        connections.inc()
        return handler()

    loop = asyncio.get_running_loop()
    listening = await loop.create_server(
        accepted, config.address, config.port, ssl=tls_context(config), backlog=512, reuse_address=True
    )
    log.info("extender listening on %s:%d%s", config.address, config.port, config.prefix)
    try:
        await stop.wait()
    finally:
        listening.close()  # no new connections; the open ones end with the runner
        await runner.cleanup()
        await listening.wait_closed()


def _json(body: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
