"""The fake API server's HTTP side: paths to resources, discovery, TokenRequest, and the handler that serves
the store's objects with faults applied (tests.fakes.apiserver holds the server and its store)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from tests.fakes.dra import Invalid, validate_slice
from tests.fakes.rbac import check_claim_status, user_of
from tests.fakes.store import REASONS, RESOURCES, ApiError, Guard, Resource, status_body

if TYPE_CHECKING:
    from tests.fakes.apiserver import FakeApiServer


@dataclass(frozen=True)
class Request:
    """One request as the server received it (:attr:`FakeApiServer.requests` logs them all)."""

    method: str
    path: str
    query: dict[str, str]
    authorization: str = ""


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
    if subresource not in ("", "status", "binding", "eviction") or len(parts) > 3:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
    return resource, namespace, name, subresource


class QuietServer(ThreadingHTTPServer):
    def get_request(self) -> tuple[socket.socket, Any]:
        """Go's net/http (and so kube-apiserver) disables Nagle; without it, a response written as headers
        then body waits for the client's delayed ACK, 40 ms a request."""
        conn, address = super().get_request()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that hang up (cut watches, timeouts) are part of the tests, not errors."""


def handler_for(server: FakeApiServer) -> type[BaseHTTPRequestHandler]:
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
            with server.lock:
                server.requests.append(Request(method, parts.path, query, self.headers.get("Authorization") or ""))
                fault = next((f for f in server.faults if f.matches(method, parts.path, watching=watching)), None)
                if fault is not None:
                    fault.hits += 1
            if server.expired(self.headers.get("Authorization") or ""):
                with server.lock:
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
                    self._stream(server.watch(resource, namespace, query))
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
            if sub == "eviction":
                if method != "POST" or namespace is None or name is None:
                    raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on evictions")
                return 201, evict(server.store, namespace, name, _json(body))
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
            guard = self._guard(method, resource.plural, sub, name)
            if method == "PUT":
                new = _json(body)
                rv = (new.get("metadata") or {}).get("resourceVersion")
                return 200, server.store.update(
                    resource, scope, name, new, subresource=sub, precondition_rv=rv, guard=guard
                )
            if method == "PATCH":
                content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                return 200, server.store.patch(resource, scope, name, body, content_type, subresource=sub, guard=guard)
            if method == "DELETE" and not sub:
                options = _json(body) if body else {}
                if "gracePeriodSeconds" in query:
                    options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
                return 200, server.store.delete(resource, scope, name, options)
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

        def _guard(self, method: str, plural: str, sub: str, name: str) -> Guard | None:
            """What the caller's permissions refuse of this write (``tests.fakes.rbac``), checked on the stored
            object under the store's lock."""
            if plural != "resourceclaims" or sub != "status":
                return None
            user = user_of(self.headers.get("Authorization") or "", server.issued_tokens)
            verb = "update" if method == "PUT" else "patch"

            def guard(old: dict[str, Any], new: dict[str, Any]) -> None:
                check_claim_status(server.store, user, version=server.version, verb=verb, name=name, old=old, new=new)

            return guard

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


def evict(store: Any, namespace: str, name: str, eviction: dict[str, Any]) -> dict[str, Any]:
    """The Eviction API as kube-apiserver serves it: refused (429) while a PodDisruptionBudget that selects
    the pod allows no disruption, else the pod is deleted with the eviction's delete options and each
    budget that selects it has one disruption fewer."""
    if eviction.get("kind") != "Eviction" or (eviction.get("metadata") or {}).get("name") != name:
        raise ApiError(400, "BadRequest", f"name in URL does not match name in Eviction object: {name}")
    pod = store.read(RESOURCES["pods"], namespace, name)
    labels = (pod.get("metadata") or {}).get("labels") or {}
    budgets = [
        pdb
        for pdb in store.list_page(RESOURCES["poddisruptionbudgets"], namespace, {}).get("items", [])
        if all(
            labels.get(k) == v
            for k, v in (((pdb.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}).items()
        )
    ]
    for pdb in budgets:
        if int((pdb.get("status") or {}).get("disruptionsAllowed") or 0) <= 0:
            raise ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.")
    for pdb in budgets:
        pdb["status"]["disruptionsAllowed"] = int(pdb["status"]["disruptionsAllowed"]) - 1
        store.update(
            RESOURCES["poddisruptionbudgets"],
            namespace,
            pdb["metadata"]["name"],
            pdb,
            subresource="status",
            precondition_rv=None,
        )
    store.delete(RESOURCES["pods"], namespace, name, eviction.get("deleteOptions") or {})
    return {"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201}
