"""A fake Kubernetes API server over HTTP on loopback, for the real ``kubernetes`` client.

It keeps objects in memory and answers the calls gpushared makes the way kube-apiserver does: list and
watch with field and label selectors, resourceVersion on every write with 409 Conflict on a stale one,
JSON / merge / strategic-merge patches, the status subresource (writes to the main resource keep the old
status, writes to /status keep the old spec), ``pods/binding`` (409 when already bound, binding
annotations copied onto the pod), graceful pod deletion, and events. Watches replay history from a
resourceVersion and answer 410 Gone once it has been compacted away.

Faults are injected per request (:class:`Fault`: a status code, latency, a cut connection) or on open
watches (:meth:`FakeApiServer.expire_watches`, :meth:`FakeApiServer.cut_watches`, :meth:`compact`).
Every request is logged in :attr:`FakeApiServer.requests` so tests can assert what was (not) asked.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime
import itertools
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes

from gpushared.kube.credentials import Credentials, StaticCredential
from gpushared.kube.rest import Rest
from tests.fakes.patches import PatchError, json_patch, merge_patch, strategic_merge_patch
from tests.fakes.selectors import SelectorError, field_selector, label_selector


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    has_status: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES = {
    r.plural: r
    for r in (
        Resource("", "v1", "pods", "Pod", namespaced=True, has_status=True),
        Resource("", "v1", "nodes", "Node", namespaced=False, has_status=True),
        Resource("", "v1", "events", "Event", namespaced=True),
        Resource("", "v1", "configmaps", "ConfigMap", namespaced=True),
        Resource("", "v1", "namespaces", "Namespace", namespaced=False, has_status=True),
        Resource("", "v1", "serviceaccounts", "ServiceAccount", namespaced=True),
        Resource("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True),
    )
}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        return status_body(self.code, self.reason, self.message)


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


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
class _Event:
    rv: int
    type: str
    plural: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeApiServer:
    """Start with ``with FakeApiServer() as api:``; ``api.rest()`` is gpushared's client for it, and
    ``api.client()`` the upstream kubernetes client's (a second opinion on what the fake serves)."""

    def __init__(self, *, history: int = 10_000) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        # Versions start above 0: a watch from "0" means "from now, with the current objects replayed".
        self._rv = itertools.count(2)
        self._current_rv = 1
        self._events: list[_Event] = []
        self._history = history
        self._compacted_rv = 0
        self._watches: list[_Watch] = []
        self._stalled = False
        self.faults: list[Fault] = []
        self.requests: list[Request] = []
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

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
        with self._lock:
            self._events.clear()
            self._compacted_rv = self._current_rv

    @property
    def open_watches(self) -> int:
        with self._lock:
            return len(self._watches)

    # --- direct access for tests ------------------------------------------------------------------------

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        plural = _plural_of(obj)
        namespace = (obj.get("metadata") or {}).get("namespace", "default") if RESOURCES[plural].namespaced else ""
        return self._create(RESOURCES[plural], namespace, _clone(obj))

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        if RESOURCES[plural].namespaced and not namespace:
            namespace = "default"
        with self._lock:
            obj = self._objects.get((plural, namespace, name))
            return _clone(obj) if obj is not None else None

    def objects(self, plural: str) -> list[dict[str, Any]]:
        with self._lock:
            return [_clone(o) for (p, _, _), o in sorted(self._objects.items()) if p == plural]

    @property
    def resource_version(self) -> int:
        return self._current_rv

    # --- storage -----------------------------------------------------------------------------------------

    def _commit(
        self,
        resource: Resource,
        kind: str,
        key: tuple[str, str, str],
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Store (or delete) under the lock, bump resourceVersion, record the event, wake watchers."""
        rv = next(self._rv)
        self._current_rv = rv
        if obj is None:
            assert old is not None
            gone = _clone(old)
            gone["metadata"]["resourceVersion"] = str(rv)
            del self._objects[key]
            event = _Event(rv, "DELETED", resource.plural, gone, old)
            result = gone
        else:
            obj["metadata"]["resourceVersion"] = str(rv)
            self._objects[key] = obj
            event = _Event(rv, kind, resource.plural, _clone(obj), old)
            result = obj
        self._events.append(event)
        if len(self._events) > self._history:
            dropped = self._events[: len(self._events) - self._history]
            self._compacted_rv = dropped[-1].rv
            del self._events[: len(dropped)]
        self._changed.notify_all()
        return _clone(result)

    def _create(self, resource: Resource, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", f"{resource.kind} is invalid: metadata.name: Required value")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if resource.namespaced:
            if meta.get("namespace", namespace) != namespace:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the object does not match the namespace on the request",
                )
            meta["namespace"] = namespace
        body["apiVersion"], body["kind"] = resource.api_version, resource.kind
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())
        meta.pop("resourceVersion", None)
        if resource.plural == "pods":
            body.setdefault("spec", {}).setdefault("terminationGracePeriodSeconds", 30)
            body.setdefault("status", {}).setdefault("phase", "Pending")
        key = (resource.plural, namespace, meta["name"])
        with self._lock:
            if key in self._objects:
                raise ApiError(409, "AlreadyExists", f'{resource.plural} "{meta["name"]}" already exists')
            return self._commit(resource, "ADDED", key, body, None)

    def _current(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        obj = self._objects.get((resource.plural, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{resource.plural} "{name}" not found')
        return obj

    def _update(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        new: dict[str, Any],
        *,
        subresource: str,
        precondition_rv: str | None,
    ) -> dict[str, Any]:
        """Store ``new`` in place of the current object, keeping what this endpoint may not change."""
        with self._lock:
            old = self._current(resource, namespace, name)
            current_rv = old["metadata"]["resourceVersion"]
            if precondition_rv and precondition_rv != current_rv:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {resource.plural} "{name}": '
                    "the object has been modified; "
                    "please apply your changes to the latest version and try again",
                )
            new = _clone(new)
            meta = new.setdefault("metadata", {})
            if meta.get("uid") not in (None, old["metadata"]["uid"]):
                raise _uid_conflict(meta["uid"], old["metadata"]["uid"])
            for immutable in ("name", "namespace", "uid", "creationTimestamp"):
                if immutable in old["metadata"]:
                    meta[immutable] = old["metadata"][immutable]
            if old["metadata"].get("deletionTimestamp"):
                meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
                meta["deletionGracePeriodSeconds"] = old["metadata"].get("deletionGracePeriodSeconds")
            new["apiVersion"], new["kind"] = resource.api_version, resource.kind
            if resource.has_status:
                if subresource == "status":
                    new["spec"] = _clone(old.get("spec"))
                else:
                    new["status"] = _clone(old.get("status"))
            if resource.plural == "pods" and subresource != "status":
                _check_pod_spec_update(old.get("spec") or {}, new.get("spec") or {})
            if new == old:
                return _clone(old)  # a no-op write does not bump resourceVersion
            return self._commit(resource, "MODIFIED", (resource.plural, namespace, name), new, _clone(old))

    def _patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        body: bytes,
        content_type: str,
        *,
        subresource: str,
    ) -> dict[str, Any]:
        try:
            patch = json.loads(body or b"null")
        except json.JSONDecodeError as exc:
            raise ApiError(400, "BadRequest", f"invalid JSON in patch: {exc}") from None
        with self._lock:
            current = _clone(self._current(resource, namespace, name))
            try:
                if content_type == "application/json-patch+json":
                    patched = json_patch(current, patch)
                elif content_type == "application/merge-patch+json":
                    patched = merge_patch(current, patch)
                elif content_type == "application/strategic-merge-patch+json":
                    patched = strategic_merge_patch(current, patch)
                else:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "the body of the request was in an unknown format - accepted media types include: "
                        "application/json-patch+json, application/merge-patch+json, "
                        f"application/strategic-merge-patch+json (got {content_type})",
                    )
            except PatchError as exc:
                raise ApiError(exc.status, REASONS[exc.status], str(exc)) from None
            if not isinstance(patched, dict):
                raise ApiError(422, "Invalid", "the patch did not produce an object")
            wanted_rv = (patched.get("metadata") or {}).get("resourceVersion")
            return self._update(resource, namespace, name, patched, subresource=subresource, precondition_rv=wanted_rv)

    def _delete(self, resource: Resource, namespace: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            old = self._current(resource, namespace, name)
            preconditions = options.get("preconditions") or {}
            if preconditions.get("uid") not in (None, old["metadata"]["uid"]):
                raise _uid_conflict(preconditions["uid"], old["metadata"]["uid"])
            if preconditions.get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
                raise ApiError(409, "Conflict", "Precondition failed: resourceVersion in precondition does not match")
            key = (resource.plural, namespace, name)
            grace = options.get("gracePeriodSeconds")
            if resource.plural == "pods" and (old.get("spec") or {}).get("nodeName"):
                if grace is None:
                    grace = old["metadata"].get(
                        "deletionGracePeriodSeconds", old["spec"].get("terminationGracePeriodSeconds", 30)
                    )
                if grace > 0:
                    # A bound pod is only marked; its kubelet stops the containers, then deletes with grace 0.
                    terminating = _clone(old)
                    if terminating["metadata"].get("deletionTimestamp") is None:
                        terminating["metadata"]["deletionTimestamp"] = _now()
                    terminating["metadata"]["deletionGracePeriodSeconds"] = grace
                    if terminating == old:
                        return _clone(old)
                    return self._commit(resource, "MODIFIED", key, terminating, _clone(old))
            return self._commit(resource, "DELETED", key, None, _clone(old))

    def _bind(self, namespace: str, name: str, binding: dict[str, Any]) -> dict[str, Any]:
        pods = RESOURCES["pods"]
        target = (binding.get("target") or {}).get("name")
        if not target:
            raise ApiError(422, "Invalid", "Binding is invalid: target.name: Required value")
        with self._lock:
            pod = self._current(pods, namespace, name)
            meta = binding.get("metadata") or {}
            if meta.get("uid") not in (None, "", pod["metadata"]["uid"]):
                raise _uid_conflict(meta["uid"], pod["metadata"]["uid"])
            if pod["metadata"].get("deletionTimestamp"):
                raise ApiError(409, "Conflict", f"pod {name} is being deleted, cannot be assigned to a host")
            if (pod.get("spec") or {}).get("nodeName"):
                raise ApiError(409, "Conflict", f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
            bound = _clone(pod)
            bound["spec"]["nodeName"] = target
            if meta.get("annotations"):
                bound["metadata"].setdefault("annotations", {}).update(meta["annotations"])
            conditions = [c for c in bound["status"].get("conditions") or [] if c.get("type") != "PodScheduled"]
            conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()})
            bound["status"]["conditions"] = conditions
            self._commit(pods, "MODIFIED", ("pods", namespace, name), bound, _clone(pod))
        return status_body(201, "", "")

    def _list(self, resource: Resource, namespace: str | None, query: dict[str, str]) -> dict[str, Any]:
        try:
            fields = field_selector(query.get("fieldSelector"), plural=resource.plural)
            labels = label_selector(query.get("labelSelector"))
        except SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from None
        limit = int(query.get("limit") or 0)
        start = int(query["continue"]) if query.get("continue") else 0
        meta: dict[str, Any] = {}
        with self._lock:
            selected = [
                obj
                for (plural, ns, _), obj in sorted(self._objects.items())
                if plural == resource.plural and (namespace is None or ns == namespace) and fields(obj) and labels(obj)
            ]
            if limit:
                if start + limit < len(selected):
                    meta["continue"] = str(start + limit)
                    meta["remainingItemCount"] = len(selected) - start - limit
                selected = selected[start : start + limit]
            items = [_clone(obj) for obj in selected]  # only the page: a 150k-pod list is 300 pages
            meta["resourceVersion"] = str(self._current_rv)
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": meta,
            "items": items,
        }

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

    def _events_after(self, since: int, plural: str) -> list[_Event]:
        """History is in resourceVersion order: find the start by bisection, not by scanning all of it
        on every wake of every watch (which made benchmarks with 100k objects measure this fake)."""
        start = bisect.bisect_right(self._events, since, key=lambda e: e.rv)
        return [e for e in self._events[start:] if e.plural == plural]

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
                since = self._current_rv
                initial = [
                    {"type": "ADDED", "object": _clone(obj)}
                    for (plural, _, _), obj in sorted(self._objects.items())
                    if plural == resource.plural and selected(obj)
                ]
            elif since < self._compacted_rv:
                initial = [
                    {
                        "type": "ERROR",
                        "object": status_body(
                            410, "Expired", f"too old resource version: {since} ({self._compacted_rv})"
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
                    pending = self._events_after(since, resource.plural)
                    if not pending and not (watch.expire or watch.cut):
                        self._changed.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                        pending = self._events_after(since, resource.plural)
                    # Everything up to here is seen, other kinds' events too: a node watch must not scan
                    # every pod event since the last node changed on each wake.
                    seen = self._current_rv
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


def _translate(event: _Event, selected: Any) -> dict[str, Any] | None:
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


def _uid_conflict(wanted: str, actual: str) -> ApiError:
    return ApiError(
        409, "Conflict", f"Precondition failed: UID in precondition: {wanted}, UID in object meta: {actual}"
    )


def _check_pod_spec_update(old: dict[str, Any], new: dict[str, Any]) -> None:
    """kube-apiserver lets an update change only images, activeDeadlineSeconds and tolerations of a pod."""
    comparable_old = _clone(old)
    for field_name in ("containers", "initContainers"):
        for old_c, new_c in zip(comparable_old.get(field_name) or [], new.get(field_name) or [], strict=False):
            if "image" in new_c:
                old_c["image"] = new_c["image"]
    for mutable in ("activeDeadlineSeconds", "tolerations"):
        comparable_old.pop(mutable, None)
    comparable_new = {k: v for k, v in new.items() if k not in ("activeDeadlineSeconds", "tolerations")}
    if comparable_old != comparable_new:
        raise ApiError(
            422,
            "Invalid",
            "Pod is invalid: spec: Forbidden: pod updates may not change fields other than "
            "`spec.containers[*].image`, `spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, "
            "`spec.tolerations` (only additions to existing tolerations)",
        )


def _plural_of(obj: dict[str, Any]) -> str:
    for resource in RESOURCES.values():
        if resource.kind == obj.get("kind"):
            return resource.plural
    raise ValueError(f"unknown kind {obj.get('kind')!r}")


_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))(?P<rest>(?:/[^/]+)*)/?$")


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
            if fault is not None and fault.applied:
                with contextlib.suppress(ApiError):
                    self._dispatch(method, parts.path, query, body)
            if fault is not None:
                if fault.delay:
                    time.sleep(fault.delay)
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
            resource, namespace, name, sub = _route(path)
            scope = namespace if resource.namespaced else ""
            if sub in {"bindings", "binding"}:
                if method != "POST":
                    raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on bindings")
                binding = _json(body)
                pod_name = name if sub == "binding" else (binding.get("metadata") or {}).get("name")
                if not pod_name or namespace is None:
                    raise ApiError(422, "Invalid", "Binding is invalid: metadata.name: Required value")
                return 201, server._bind(namespace, pod_name, binding)
            if name is None:
                if method == "GET":
                    return 200, server._list(resource, namespace if resource.namespaced else None, query)
                if method == "POST":
                    if resource.namespaced and namespace is None:
                        raise ApiError(405, "MethodNotAllowed", "create needs a namespace")
                    return 201, server._create(resource, scope or "", _json(body))
                raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
            assert scope is not None
            if method == "GET":
                with server._lock:
                    return 200, _clone(server._current(resource, scope, name))
            if method == "PUT":
                new = _json(body)
                rv = (new.get("metadata") or {}).get("resourceVersion")
                return 200, server._update(resource, scope, name, new, subresource=sub, precondition_rv=rv)
            if method == "PATCH":
                content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                return 200, server._patch(resource, scope, name, body, content_type, subresource=sub)
            if method == "DELETE" and not sub:
                options = _json(body) if body else {}
                if "gracePeriodSeconds" in query:
                    options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
                return 200, server._delete(resource, scope, name, options)
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


def _clone(obj: Any) -> Any:
    """A copy of a JSON tree (dicts, lists, scalars): every stored object came in as JSON. A third of
    ``copy.deepcopy``'s time, which was a third of this fake's CPU per write in the extender benchmark."""
    kind = type(obj)
    if kind is dict:
        return {key: _clone(value) for key, value in obj.items()}
    if kind is list:
        return [_clone(value) for value in obj]
    return obj


def _json(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body or b"{}")
    except json.JSONDecodeError as exc:
        raise ApiError(400, "BadRequest", f"invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "BadRequest", "expected a JSON object")
    return value
