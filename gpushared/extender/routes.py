"""What each request to the extender gets, whichever HTTP version carried it.

The extender's port speaks HTTP/1.1 (aiohttp, ``server.py``) and HTTP/2 (``http2.py``); each protocol only
turns its bytes into a :class:`Call` and an :class:`Answer` back into bytes. Everything a caller can be
told — the verbs, authentication, readiness, the body limits, forwarding to the leader, 404 and 405 — is
decided here once, so the two versions cannot answer the same request differently.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpushared import __version__
from gpushared.core.admission import scheduler_route
from gpushared.core.bodies import meta_of
from gpushared.core.report import node_report
from gpushared.extender import wire
from gpushared.extender.config import ServerConfig
from gpushared.extender.metrics import Metrics
from gpushared.extender.scheduler import BindError, Scheduler

log = logging.getLogger(__name__)

Ready = Callable[[], tuple[bool, str]]
#: None: serve the verbs here. A URL: the leader's, to forward them to. "": no leader known yet.
Leader = Callable[[], str | None]
#: The header a follower marks a forwarded verb with, so a leader that lost its Lease meanwhile does not
#: forward it again.
FORWARDED = "X-Gpushared-Forwarded"
JSON = "application/json"
#: Admission reviews decoded at once, on a worker thread (``Routes.mutate``).
WEBHOOK_THREADS = 1
#: The largest admission review the webhook reads: kube-apiserver takes request bodies of at most 3 MiB,
#: so a pod it asks about is no larger; anyone else's larger review is refused unread (413).
MAX_REVIEW_BYTES = 3 * 2**20 + 64 * 2**10
TEXT = "text/plain; charset=utf-8"


class BodyTooLarge(Exception):
    """The request's body passed ``ServerConfig.max_body_bytes``: raised by :attr:`Call.read`."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    content_type: str = JSON


@dataclass(frozen=True, slots=True)
class Call:
    """One request as the routes see it. ``read`` returns the body (raising :class:`BodyTooLarge` past the
    limit); the routes decide whether and when to read it, so a refused caller's body is never waited for."""

    method: str
    #: decoded, without the query
    path: str
    read: Callable[[], Awaitable[bytes]]
    #: the TLS connection it came on (its client certificate), None over plain HTTP
    ssl_object: ssl.SSLObject | None = None
    remote: str | None = None
    forwarded: bool = False


Handler = Callable[[Call], Awaitable[Answer]]


def json_answer(body: Any, *, status: int = 200) -> Answer:
    return Answer(status, orjson.dumps(body))


class Routes:
    """The extender's endpoints. :meth:`answer` is the one entry both HTTP versions call."""

    def __init__(
        self, scheduler: Scheduler, config: ServerConfig, *, ready: Ready, leader: Leader, metrics: Metrics
    ) -> None:
        self.scheduler = scheduler
        self.config = config
        self.ready = ready
        self.leader = leader
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._webhook_slots = asyncio.Semaphore(WEBHOOK_THREADS)
        prefix = config.prefix.rstrip("/")
        self._inspect = f"{prefix}/inspect/"
        self._table: dict[str, dict[str, Handler]] = {
            f"{prefix}/filter": {"POST": self.verb("filter", self.filter)},
            f"{prefix}/prioritize": {"POST": self.verb("prioritize", self.prioritize)},
            f"{prefix}/prioritize-no-gpu": {"POST": self.verb("prioritize-no-gpu", self.prioritize_no_gpu)},
            f"{prefix}/bind": {"POST": self.verb("bind", self.bind)},
            f"{prefix}/mutate": {"POST": self.verb("mutate", self.mutate, stateless=True)},
            f"{prefix}/inspect": {"GET": self.inspect_all},
            "/healthz": {"GET": self.healthz},
            "/readyz": {"GET": self.readyz},
            "/metrics": {"GET": self.prometheus},
            "/version": {"GET": self.version},
        }

    async def answer(self, call: Call) -> Answer:
        methods = self._table.get(call.path)
        if methods is None and call.path.startswith(self._inspect):
            methods = {"GET": self.inspect_node}
        if methods is None:
            return Answer(404, b"404: Not Found", TEXT)
        handler = methods.get(call.method)
        if handler is None:
            return Answer(405, f"405: {call.method} is not allowed here; {', '.join(methods)} is".encode(), TEXT)
        return await handler(call)

    async def close(self) -> None:
        await self.scheduler.close()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, path: str, raw: bytes, leader: str) -> Answer:
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
                leader + path, data=raw, headers={"Content-Type": JSON, FORWARDED: "1"}
            ) as answer:
                return Answer(answer.status, await answer.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            return json_answer({"Error": f"the leader at {leader} did not answer: {exc}"}, status=503)

    def verb(self, name: str, handler: Callable[[bytes], Awaitable[Answer]], *, stateless: bool = False) -> Handler:
        """Authentication, readiness, body limits and timeouts, 400 for a malformed body, and the latency
        metric.

        A ``stateless`` verb answers from the request alone (the webhook): every replica serves it, synced
        or not, leader or not, and it asks for no client certificate."""

        seconds, errors = self.metrics.seconds.labels(verb=name), self.metrics.errors.labels(verb=name)  # once

        async def serve(call: Call) -> Answer:
            started = time.perf_counter()
            try:
                refused = None if stateless else self._unauthenticated(call, name)
                if refused is not None:
                    errors.inc()
                    log.warning("%s from %s refused: %s", name, call.remote, refused[1])
                    return json_answer({"Error": refused[1]}, status=refused[0])
                ok, why = (True, "") if stateless else self.ready()
                if not ok:
                    errors.inc()
                    return json_answer({"Error": why}, status=503)
                try:
                    async with asyncio.timeout(self.config.read_timeout):  # no task per request, unlike wait_for
                        raw = await call.read()
                except BodyTooLarge:
                    errors.inc()
                    return json_answer(
                        {"Error": f"{name}: body larger than {self.config.max_body_bytes} bytes"}, status=413
                    )
                except TimeoutError:
                    errors.inc()
                    return json_answer({"Error": f"{name}: request body too slow"}, status=408)
                leader = None if stateless else self.leader()
                if leader is not None:
                    if call.forwarded or not leader:
                        errors.inc()
                        return json_answer(
                            {"Error": "this replica is not the leader, and no leader is known"}, status=503
                        )
                    return await self._forward(call.path, raw, leader)
                try:
                    return await handler(raw)
                except wire.WireError as exc:
                    errors.inc()
                    return json_answer({"Error": str(exc)}, status=400)
                except Exception as exc:  # a bug, never a caller's fault: say so, keep serving
                    errors.inc()
                    log.exception("%s failed", name)
                    return json_answer(
                        {"Error": f"{name}: internal error ({type(exc).__name__}); see the log"}, status=500
                    )
            finally:
                seconds.observe(time.perf_counter() - started)

        return serve

    def _unauthenticated(self, call: Call, verb: str = "") -> tuple[int, str] | None:
        """The HTTP status and reason the caller may not use the verbs with (None: it may): 401 without a
        client certificate, 403 with one whose name is not allowed. Without --client-ca anyone may read
        (filter, prioritize), and nobody may bind unless --insecure-bind says so: a bind changes the
        cluster, and without client certificates anyone who knows a pod's UID could bind it anywhere."""
        if self.config.client_ca is None:
            if verb == "bind" and not self.config.insecure_bind:
                return 403, (
                    "bind needs client authentication: start the extender with --tls-cert, --tls-key and "
                    "--client-ca (or --insecure-bind, where anyone who reaches this port may bind pods)"
                )
            return None
        names = certificate_names(call.ssl_object)
        if names is None:
            return 401, "a client certificate signed by the extender's client CA is required"
        if self.config.client_names and not names & self.config.client_names:
            return 403, f"client certificate {sorted(names)} is not allowed here"
        return None

    async def filter(self, raw: bytes) -> Answer:
        args = wire.parse_args(raw, verb="filter", max_nodes=self.config.max_nodes)
        passed, failed, error = self.scheduler.filter(args)
        return json_answer(wire.filter_result(args, passed=passed, failed=failed, error=error))

    async def prioritize(self, raw: bytes) -> Answer:
        args = wire.parse_args(raw, verb="prioritize", max_nodes=self.config.max_nodes)
        return json_answer(wire.priority_list(self.scheduler.prioritize(args)))

    async def prioritize_no_gpu(self, raw: bytes) -> Answer:
        args = wire.parse_args(raw, verb="prioritize-no-gpu", max_nodes=self.config.max_nodes)
        return json_answer(wire.priority_list(self.scheduler.prioritize_no_gpu(args)))

    async def bind(self, raw: bytes) -> Answer:
        args = wire.parse_binding(raw)
        try:
            await self.scheduler.bind(args)
        except BindError as exc:
            self.metrics.errors.labels(verb="bind").inc()
            log.warning("bind refused: %s", exc)
            return json_answer(wire.binding_result(str(exc)))
        return json_answer(wire.binding_result())

    async def mutate(self, raw: bytes) -> Answer:
        """The mutating admission webhook: the API server calls it for every pod created in the namespaces
        its configuration selects. Stateless (``verb``): the answer depends on the pod alone. No client
        certificate is asked for, because the API server presents none unless configured to; a caller gets
        only a patch for the object it sent, and nothing changes here.

        Anyone who reaches the port may send it reviews: one is read only up to ``MAX_REVIEW_BYTES`` (what
        the API server can send), and decoding it (and freeing it) is done on a worker thread, one review
        at a time, so the event loop waits at most for one decode (a C call that holds the interpreter)
        and answers the other routes between them. 16 clients sending 5.9 MiB reviews of small objects
        held the loop 171 ms and /healthz about a second when every decode ran on the loop (issue #39)."""
        if len(raw) > MAX_REVIEW_BYTES:
            self.metrics.errors.labels(verb="mutate").inc()
            return json_answer(
                {"Error": f"mutate: an admission review of {len(raw)} bytes; the API server sends at most 3 MiB"},
                status=413,
            )
        async with self._webhook_slots:
            return await asyncio.to_thread(self._mutate, raw)

    def _mutate(self, raw: bytes) -> Answer:
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
        return json_answer(wire.admission_response(review, patch))

    def _report(self, name: str, call: Call) -> dict[str, Any] | None:
        snapshot = self.scheduler.cache.snapshot(name)
        if snapshot is None:
            return None
        inventory, holdings, address = snapshot
        report = node_report(name=name, address=address, inventory=inventory, holdings=holdings)
        if not self._may_see_pods(call):
            _hide_pods(report)
        return report

    def _may_see_pods(self, call: Call) -> bool:
        """Pod names (and so which tenants run where) only to authenticated callers, unless the flag says."""
        if self.config.public_pod_names:
            return True
        return self.config.client_ca is not None and self._unauthenticated(call) is None

    async def inspect_all(self, call: Call) -> Answer:
        nodes = [r for r in (self._report(n, call) for n in self.scheduler.cache.node_names()) if r is not None]
        self.metrics.nodes.set(len(nodes))
        return json_answer({"nodes": nodes})

    async def inspect_node(self, call: Call) -> Answer:
        name = call.path.removeprefix(self._inspect)
        found = self._report(name, call) if name and "/" not in name else None
        if found is None:
            return json_answer(
                {"nodes": [], "error": f"node {name} is not a gpushared node known to the extender"}, status=404
            )
        return json_answer({"nodes": [found]})

    async def healthz(self, call: Call) -> Answer:
        return Answer(200, b"ok\n", TEXT)

    async def readyz(self, call: Call) -> Answer:
        ok, why = self.ready()
        return Answer(200 if ok else 503, (("ok" if ok else why) + "\n").encode(), TEXT)

    async def prometheus(self, call: Call) -> Answer:
        return Answer(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)

    async def version(self, call: Call) -> Answer:
        return Answer(200, (__version__ + "\n").encode(), TEXT)


def _hide_pods(report: dict[str, Any]) -> None:
    """Amounts stay (they are the node's state); who holds them goes."""
    for holder in [*(p for dev in report["devs"] for p in dev["pods"]), *report["pending"]]:
        holder["name"] = holder["namespace"] = HIDDEN


#: What an unauthenticated caller sees in place of a pod's name and namespace.
HIDDEN = "(hidden)"


def certificate_names(ssl_object: ssl.SSLObject | None) -> frozenset[str] | None:
    """The common names and DNS names of the caller's verified client certificate; None without one.
    Decoded once per connection: over HTTP/2 every call of kube-scheduler's comes on the same one."""
    if ssl_object is None:
        return None
    try:
        return _NAMES[ssl_object]
    except KeyError:
        pass
    certificate: Any = ssl_object.getpeercert()  # typeshed's type is looser than what it returns
    names = None
    if certificate:
        found = {value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"}
        found |= {value for kind, value in certificate.get("subjectAltName", ()) if kind == "DNS"}
        names = frozenset(found)
    _NAMES[ssl_object] = names
    return names


#: Each open connection's client certificate names, gone with the connection.
_NAMES: weakref.WeakKeyDictionary[ssl.SSLObject, frozenset[str] | None] = weakref.WeakKeyDictionary()
