"""A fake Kubernetes API server over HTTP on loopback, for the real ``kubernetes`` client.

It answers the calls gpushared makes the way kube-apiserver does: list and watch with field and label
selectors, reads and writes of the objects its store keeps (``tests.fakes.store``: resourceVersions,
patches, the status subresource, ``pods/binding``, graceful pod deletion, events). Watches replay the
store's history from a resourceVersion and answer 410 Gone once it has been compacted away.

Faults are injected per request (:class:`Fault`: a status code, latency, a cut connection) or on open
watches (:meth:`FakeApiServer.expire_watches`, :meth:`FakeApiServer.cut_watches`, :meth:`compact`).
Every request is logged in :attr:`FakeApiServer.requests` so tests can assert what was (not) asked.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes

from gpushared.kube.credentials import Credentials, StaticCredential
from gpushared.kube.rest import Rest
from tests.fakes.dra import Invalid, validate_slice
from tests.fakes.selectors import SelectorError, field_selector, label_selector
from tests.fakes.store import (
    REASONS,
    RESOURCES,
    ApiError,
    Event,
    Resource,
    Store,
    clone,
    plural_of,
    status_body,
)


@dataclass
class Fault:
    """Answer matching requests with ``status``, after ``delay`` seconds, or cut the connection.

    ``path`` is a regular expression searched in the request path; ``watch`` restricts to watch (True)
    or non-watch (False) requests; ``times`` is how many requests it hits (None: until removed). A 410 on
    a watch is sent as the API server does: HTTP 200 with an ERROR event. With ``applied`` the request is
    carried out first and only its answer is delayed, replaced or cut: a write that lands although the
    client saw it fail.
    """

    method: str | None = None
    path: str = ""
    status: int | None = None
    delay: float = 0.0
    cut: bool = False
    watch: bool | None = None
    times: int | None = 1
    message: str = "injected fault"
    applied: bool = False
    hits: int = 0

    def matches(self, method: str, path: str, *, watching: bool) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method is not None and self.method != method:
            return False
        if self.watch is not None and self.watch != watching:
            return False
        return re.search(self.path, path) is not None


@dataclass
class _Watch:
    """One open watch stream; the server flips these flags to end it."""

    expire: bool = False
    cut: bool = False


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    authorization: str = ""


class FakeApiServer:
    """Start with ``with FakeApiServer() as api:``; ``api.rest()`` is gpushared's client for it, and
    ``api.client()`` the upstream kubernetes client's (a second opinion on what the fake serves)."""

    def __init__(self, *, history: int = 10_000) -> None:
        self.store = Store(history=history)
        self._lock = self.store.lock
        self._changed = self.store.changed
        self._watches: list[_Watch] = []
        self._stalled = False
        self.faults: list[Fault] = []
        self.requests: list[Request] = []
        #: bound ServiceAccount tokens this server issued -> when they expire (Unix seconds); a request that
        #: presents one of them after that is refused 401, as a real API server refuses it. Other tokens are
        #: taken as they come.
        self.issued_tokens: dict[str, float] = {}
        #: the longest life a TokenRequest gets (its --service-account-max-token-expiration); None: as asked
        self.max_token_seconds: float | None = None
        #: requests refused because their token had expired
        self.expired_refusals = 0
        #: whether resource.k8s.io/v1 (DRA) is served, as by kube-apiserver >= 1.34; False: a 1.20 one
        self.dra_served = True
        #: what ``/version`` says; from 1.21 a request's ``?timeout=`` is its deadline all the way to storage,
        #: so a request held past it (a ``Fault`` delay) answers 504 and is not carried out
        self.version = (1, 36)
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # --- tokens --------------------------------------------------------------------------------------------

    def issue_token(self, namespace: str, service_account: str, *, seconds: float) -> str:
        """A bound ServiceAccount token as the TokenRequest API issues it: a JWT whose claims say whose it is
        and when it expires (unsigned: nothing here checks signatures, only expiry)."""
        if self.max_token_seconds is not None:
            seconds = min(seconds, self.max_token_seconds)
        now = time.time()
        claims = {
            "iss": "https://fake-apiserver",
            "sub": f"system:serviceaccount:{namespace}:{service_account}",
            "iat": int(now),
            "exp": int(now + seconds),
            "jti": secrets.token_hex(8),
            "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": service_account, "uid": "u"}},
        }

        def part(value: dict[str, Any]) -> str:
            return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

        token = f"{part({'alg': 'none'})}.{part(claims)}.sig"
        with self._lock:
            self.issued_tokens[token] = float(claims["exp"])
        return token

    def _expired(self, authorization: str) -> bool:
        token = authorization.removeprefix("Bearer ").strip()
        expires = self.issued_tokens.get(token)
        return expires is not None and time.time() >= expires

    # --- lifecycle -------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeApiServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-apiserver",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.cut_watches()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def configuration(self) -> kubernetes.client.Configuration:
        config = kubernetes.client.Configuration()
        config.host = self.url
        return config

    def client(self) -> kubernetes.client.ApiClient:
        return kubernetes.client.ApiClient(self.configuration())

    def credentials(self, *, token: str | None = None) -> Credentials:
        return Credentials(server=self.url, credential=StaticCredential(token=token), source="the fake API server")

    def rest(self, *, token: str | None = None) -> Rest:
        return Rest(self.credentials(token=token))

    def kubeconfig(self) -> dict[str, Any]:
        """A kubeconfig body pointing at this server, for components that load one from a file."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }

    # --- fault injection ---------------------------------------------------------------------------------

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def expire_watches(self) -> None:
        """Every open watch gets an ERROR event with 410 Gone and ends, as after etcd compaction."""
        with self._lock:
            for watch in self._watches:
                watch.expire = True
            self._changed.notify_all()

    def stall_watches(self, stalled: bool = True) -> None:
        """Open and new watches deliver nothing and never end while ``stalled``, as behind a proxy that
        keeps the stream open and silent; lists and writes go on. Events held back are sent afterwards."""
        with self._lock:
            self._stalled = stalled
            self._changed.notify_all()

    def cut_watches(self) -> None:
        """Every open watch connection is closed without the closing chunk, as when a proxy drops it."""
        with self._lock:
            for watch in self._watches:
                watch.cut = True
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget the event history: a watch resuming from an older resourceVersion gets 410 Gone."""
        self.store.compact()

    @property
    def open_watches(self) -> int:
        with self._lock:
            return len(self._watches)

    # --- direct access for tests ------------------------------------------------------------------------

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        plural = plural_of(obj)
        namespace = (obj.get("metadata") or {}).get("namespace", "default") if RESOURCES[plural].namespaced else ""
        return self.store.create(RESOURCES[plural], namespace, clone(obj))

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        if RESOURCES[plural].namespaced and not namespace:
            namespace = "default"
        return self.store.get(plural, name, namespace)

    def objects(self, plural: str) -> list[dict[str, Any]]:
        return self.store.all(plural)

    @property
    def resource_version(self) -> int:
        return self.store.current_rv

    # --- watch -------------------------------------------------------------------------------------------

    def _watch(
        self, resource: Resource, namespace: str | None, query: dict[str, str]
    ) -> Iterator[dict[str, Any] | None]:
        """Checks the request, then returns the stream of its events (see :meth:`_events_of`)."""
        try:
            fields = field_selector(query.get("fieldSelector"), plural=resource.plural)
            labels = label_selector(query.get("labelSelector"))
        except SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from None
        return self._events_of(resource, namespace, query, fields, labels)

    def _stall(self, watch: _Watch) -> bool:
        """While watches are stalled: wait a little and say so (a cut still ends the stream)."""
        with self._lock:
            if not self._stalled or watch.cut:
                return False
            self._changed.wait(timeout=0.5)
            return self._stalled and not watch.cut

    def _events_of(
        self, resource: Resource, namespace: str | None, query: dict[str, str], fields: Any, labels: Any
    ) -> Iterator[dict[str, Any] | None]:
        """Yields watch events; None means "nothing yet, check the connection"; ends when the watch does."""

        def selected(obj: dict[str, Any] | None) -> bool:
            if obj is None:
                return False
            ns = (obj.get("metadata") or {}).get("namespace", "")
            return (namespace is None or ns == namespace) and fields(obj) and labels(obj)

        timeout = float(query.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        watch = _Watch()
        with self._lock:
            since_text = query.get("resourceVersion") or "0"
            since = int(since_text) if since_text.isdigit() else 0
            initial: list[dict[str, Any]] = []
            if since == 0:
                since = self.store.current_rv
                initial = [
                    {"type": "ADDED", "object": clone(obj)}
                    for (plural, _, _), obj in sorted(self.store.objects.items())
                    if plural == resource.plural and selected(obj)
                ]
            elif since < self.store.compacted_rv:
                initial = [
                    {
                        "type": "ERROR",
                        "object": status_body(
                            410, "Expired", f"too old resource version: {since} ({self.store.compacted_rv})"
                        ),
                    }
                ]
                watch.expire = True
            self._watches.append(watch)
        try:
            if watch.expire:
                yield from initial
                return
            while self._stall(watch):
                yield None
            yield from initial
            while True:
                if self._stall(watch):
                    yield None
                    continue
                with self._lock:
                    pending = self.store.events_after(since, resource.plural)
                    if not pending and not (watch.expire or watch.cut):
                        self._changed.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                        pending = self.store.events_after(since, resource.plural)
                    # Everything up to here is seen, other kinds' events too: a node watch must not scan
                    # every pod event since the last node changed on each wake.
                    seen = self.store.current_rv
                    cut, expired = watch.cut, watch.expire
                    if self._stalled and not cut:
                        continue  # stalled while it waited: what came meanwhile is held back too
                if cut:
                    raise ConnectionAbortedError("watch cut by the test")
                if expired:
                    yield {"type": "ERROR", "object": status_body(410, "Expired", "too old resource version")}
                    return
                for event in pending:
                    translated = _translate(event, selected)
                    if translated is not None:
                        yield translated
                since = max(since, seen)
                if time.monotonic() >= deadline:
                    return
                yield None
        finally:
            with self._lock:
                self._watches.remove(watch)


def _translate(event: Event, selected: Any) -> dict[str, Any] | None:
    """What a watch with a selector sees: objects entering it are ADDED, objects leaving it DELETED."""
    now, before = selected(event.obj) if event.type != "DELETED" else False, selected(event.old)
    if event.type == "DELETED":
        return {"type": "DELETED", "object": event.obj} if before else None
    if now and before:
        return {"type": "MODIFIED", "object": event.obj}
    if now:
        return {"type": "ADDED", "object": event.obj}
    if before:
        return {"type": "DELETED", "object": event.obj}
    return None


_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))(?P<rest>(?:/[^/]+)*)/?$")


_DISCOVERY = re.compile(r"^/apis/([^/]+)/([^/]+)/?$")


def _resource_list(server: FakeApiServer, group: str, version: str) -> dict[str, Any]:
    """An APIResourceList, as discovery answers it; 404 for a group/version not served."""
    served = [
        r
        for r in RESOURCES.values()
        if (r.group, r.version) == (group, version) and (r.group != "resource.k8s.io" or server.dra_served)
    ]
    if not served:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource (/apis/{group}/{version})")
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}",
        "resources": [{"name": r.plural, "kind": r.kind, "namespaced": r.namespaced} for r in served],
    }


_TOKEN_REQUEST = re.compile(r"^/api/v1/namespaces/([^/]+)/serviceaccounts/([^/]+)/token$")


def _route(path: str) -> tuple[Resource, str | None, str | None, str]:
    """(resource, namespace or None for all, name or None, subresource or "") of an API path."""
    match = _PATH.match(path)
    if match is None:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
    group = match.group("group") or ""
    version = match.group("core") or match.group("version")
    parts = [p for p in match.group("rest").split("/") if p]
    namespace: str | None = None
    if len(parts) >= 3 and parts[0] == "namespaces":
        namespace, parts = parts[1], parts[2:]
    elif len(parts) == 2 and parts[0] == "namespaces":
        parts = ["namespaces", parts[1]]
    if not parts or parts[0] not in RESOURCES:
        if namespace is not None and parts == ["bindings"]:
            return RESOURCES["pods"], namespace, None, "bindings"
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
    resource = RESOURCES[parts[0]]
    if (resource.group, resource.version) != (group, version):
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
    if resource.namespaced != (namespace is not None) and len(parts) > 1:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
    name = parts[1] if len(parts) > 1 else None
    subresource = parts[2] if len(parts) > 2 else ""
    if subresource not in ("", "status", "binding") or len(parts) > 3:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
    return resource, namespace, name, subresource


class _QuietServer(ThreadingHTTPServer):
    def get_request(self) -> tuple[socket.socket, Any]:
        """Go's net/http (and so kube-apiserver) disables Nagle; without it, a response written as headers
        then body waits for the client's delayed ACK, 40 ms a request."""
        conn, address = super().get_request()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that hang up (cut watches, timeouts) are part of the tests, not errors."""


def _handler_for(server: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, method: str) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            watching = method == "GET" and query.get("watch") in ("true", "1")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            with server._lock:
                server.requests.append(Request(method, parts.path, query, self.headers.get("Authorization") or ""))
                fault = next((f for f in server.faults if f.matches(method, parts.path, watching=watching)), None)
                if fault is not None:
                    fault.hits += 1
            if server._expired(self.headers.get("Authorization") or ""):
                with server._lock:
                    server.expired_refusals += 1
                self._send(401, status_body(401, "Unauthorized", "Unauthorized"))
                return
            if fault is not None and fault.applied:
                with contextlib.suppress(ApiError):
                    self._dispatch(method, parts.path, query, body)
            if fault is not None:
                if fault.delay:
                    time.sleep(fault.delay)
                    deadline = _seconds(query.get("timeout"))
                    past = deadline is not None and fault.delay >= deadline and server.version >= (1, 21)
                    if past and not fault.applied and fault.status is None and not fault.cut:
                        message = "Timeout: request did not complete within requested timeout"
                        self._send(504, status_body(504, "Timeout", message))
                        return
                if fault.cut:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault.status is not None:
                    if watching and fault.status == 410:
                        self._stream(iter([{"type": "ERROR", "object": status_body(410, "Expired", fault.message)}]))
                    else:
                        self._send(
                            fault.status,
                            status_body(fault.status, REASONS.get(fault.status, "Unknown"), fault.message),
                        )
                    return
            try:
                if watching:
                    resource, namespace, name, _ = _route(parts.path)
                    if name is not None:
                        query["fieldSelector"] = ",".join(
                            filter(None, [query.get("fieldSelector"), f"metadata.name={name}"])
                        )
                    self._stream(server._watch(resource, namespace, query))
                    return
                code, payload = self._dispatch(method, parts.path, query, body)
            except ApiError as exc:
                self._send(exc.code, exc.status())
                return
            self._send(code, payload)

        def _dispatch(self, method: str, path: str, query: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
            token_request = _TOKEN_REQUEST.match(path)
            if token_request is not None and method == "POST":
                namespace, account = token_request.group(1), token_request.group(2)
                server.store.read(RESOURCES["serviceaccounts"], namespace, account)  # 404 for an unknown account
                spec = _json(body).get("spec") or {}
                seconds = int(spec.get("expirationSeconds") or 3600)
                if seconds < 600:
                    raise ApiError(
                        422,
                        "Invalid",
                        "spec.expirationSeconds: Invalid value: may not specify a duration less than 10 minutes",
                    )
                token = server.issue_token(namespace, account, seconds=seconds)
                status = {"token": token, "expirationTimestamp": ""}
                return 201, {
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenRequest",
                    "spec": spec,
                    "status": status,
                }
            if path == "/version" and method == "GET":
                major, minor = server.version
                return 200, {"major": str(major), "minor": str(minor), "gitVersion": f"v{major}.{minor}.0"}
            discovery = _DISCOVERY.match(path)
            if discovery is not None and method == "GET":
                return 200, _resource_list(server, discovery.group(1), discovery.group(2))
            resource, namespace, name, sub = _route(path)
            if resource.group == "resource.k8s.io" and not server.dra_served:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
            if resource.plural == "resourceslices" and method in ("POST", "PUT"):
                try:
                    validate_slice(_json(body))
                except Invalid as exc:
                    raise ApiError(422, "Invalid", f"ResourceSlice is invalid: {exc}") from None
            scope = namespace if resource.namespaced else ""
            if sub in {"bindings", "binding"}:
                if method != "POST":
                    raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on bindings")
                binding = _json(body)
                pod_name = name if sub == "binding" else (binding.get("metadata") or {}).get("name")
                if not pod_name or namespace is None:
                    raise ApiError(422, "Invalid", "Binding is invalid: metadata.name: Required value")
                return 201, server.store.bind(namespace, pod_name, binding)
            if name is None:
                if method == "GET":
                    return 200, server.store.list_page(resource, namespace if resource.namespaced else None, query)
                if method == "POST":
                    if resource.namespaced and namespace is None:
                        raise ApiError(405, "MethodNotAllowed", "create needs a namespace")
                    return 201, server.store.create(resource, scope or "", _json(body))
                raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
            assert scope is not None
            if method == "GET":
                return 200, server.store.read(resource, scope, name)
            if method == "PUT":
                new = _json(body)
                rv = (new.get("metadata") or {}).get("resourceVersion")
                return 200, server.store.update(resource, scope, name, new, subresource=sub, precondition_rv=rv)
            if method == "PATCH":
                content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                return 200, server.store.patch(resource, scope, name, body, content_type, subresource=sub)
            if method == "DELETE" and not sub:
                options = _json(body) if body else {}
                if "gracePeriodSeconds" in query:
                    options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
                return 200, server.store.delete(resource, scope, name, options)
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

        def _send(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, events: Iterator[dict[str, Any] | None]) -> None:
            """A watch: one JSON event per chunk, as kube-apiserver streams them."""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            try:
                for event in events:
                    if event is None:
                        self.wfile.flush()
                        continue
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except ConnectionAbortedError:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            finally:
                events_close = getattr(events, "close", None)
                if events_close is not None:
                    events_close()

    return Handler


def _json(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body or b"{}")
    except json.JSONDecodeError as exc:
        raise ApiError(400, "BadRequest", f"invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "BadRequest", "expected a JSON object")
    return value


def _seconds(text: str | None) -> float | None:
    """A request's ``timeout`` as Go writes a duration ("4s", "500ms", "1m"); None when absent or not read."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text or "")
    if match is None:
        return None
    return float(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match.group(2)]
