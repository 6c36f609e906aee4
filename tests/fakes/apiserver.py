"""A fake Kubernetes API server over HTTP on loopback, for the real ``kubernetes`` client.

It answers the calls gpushared makes the way kube-apiserver does: list and watch with field and label
selectors, reads and writes of the objects its store keeps (``tests.fakes.store``: resourceVersions,
patches, the status subresource, ``pods/binding``, graceful pod deletion, events). Watches replay the
store's history from a resourceVersion and answer 410 Gone once it has been compacted away.

Faults are injected per request (:class:`Fault`: a status code, latency, a cut connection) or on open
watches (:meth:`FakeApiServer.expire_watches`, :meth:`FakeApiServer.cut_watches`, :meth:`compact`).
Every request is logged in :attr:`FakeApiServer.requests` so tests can assert what was (not) asked. The HTTP
side (paths, discovery, the request handler) is ``tests.fakes.apiserver_http``.
"""

from __future__ import annotations

import base64
import bisect
import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes

from gpushared.kube.credentials import Credentials, StaticCredential
from gpushared.kube.rest import Rest
from tests.fakes.apiserver_http import QuietServer, Request, handler_for
from tests.fakes.selectors import SelectorError, field_selector, label_selector
from tests.fakes.store import RESOURCES, ApiError, Event, Resource, Store, clone, plural_of, status_body


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


class FakeApiServer:
    """Start with ``with FakeApiServer() as api:``; ``api.rest()`` is gpushared's client for it, and
    ``api.client()`` the upstream kubernetes client's (a second opinion on what the fake serves)."""

    def __init__(self, *, history: int = 10_000) -> None:
        self.store = Store(history=history)
        self.lock = self.store.lock
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
        #: how long after a write its event reaches the watches (seconds): a real API server's watch cache
        #: and the network deliver events some time after the write returned, and a list then a watch may
        #: show an object the watch of another client does not show yet
        self.watch_lag = 0.0
        self._server = QuietServer(("127.0.0.1", 0), handler_for(self))
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
        with self.lock:
            self.issued_tokens[token] = float(claims["exp"])
        return token

    def expired(self, authorization: str) -> bool:
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
        with self.lock:
            self.faults.append(fault)
        return fault

    def expire_watches(self) -> None:
        """Every open watch gets an ERROR event with 410 Gone and ends, as after etcd compaction."""
        with self.lock:
            for watch in self._watches:
                watch.expire = True
            self._changed.notify_all()

    def stall_watches(self, stalled: bool = True) -> None:
        """Open and new watches deliver nothing and never end while ``stalled``, as behind a proxy that
        keeps the stream open and silent; lists and writes go on. Events held back are sent afterwards."""
        with self.lock:
            self._stalled = stalled
            self._changed.notify_all()

    def cut_watches(self) -> None:
        """Every open watch connection is closed without the closing chunk, as when a proxy drops it."""
        with self.lock:
            for watch in self._watches:
                watch.cut = True
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget the event history: a watch resuming from an older resourceVersion gets 410 Gone."""
        self.store.compact()

    @property
    def open_watches(self) -> int:
        with self.lock:
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

    def watch(
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
        with self.lock:
            if not self._stalled or watch.cut:
                return False
            self._changed.wait(timeout=0.5)
            return self._stalled and not watch.cut

    def _shown_after(self, since: int, plural: str) -> tuple[list[Event], int]:
        """The events of ``plural`` a watch shows after ``since``, and the resourceVersion it has seen up to:
        everything stored (other kinds' events too: a node watch must not scan every pod event since the last
        node changed on each wake), or with ``watch_lag`` only what was stored that long ago."""
        if self.watch_lag <= 0:
            return self.store.events_after(since, plural), self.store.current_rv
        cutoff = time.monotonic() - self.watch_lag
        seen = since
        for event in reversed(self.store.events):
            if event.rv <= since:
                break
            if event.at <= cutoff:
                seen = event.rv
                break
        return [e for e in self.store.events_after(since, plural) if e.rv <= seen], seen

    def _next_wake(self, since: int) -> float:
        """How long a watch waits for a change: with ``watch_lag``, until the next stored event is shown."""
        if self.watch_lag <= 0:
            return 0.5
        events = self.store.events
        start = bisect.bisect_right(events, since, key=lambda e: e.rv)
        if start >= len(events):
            return 0.5
        return max(0.001, min(0.5, events[start].at + self.watch_lag - time.monotonic()))

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
        with self.lock:
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
                with self.lock:
                    pending, seen = self._shown_after(since, resource.plural)
                    if not pending and not (watch.expire or watch.cut):
                        self._changed.wait(timeout=min(self._next_wake(since), max(0.0, deadline - time.monotonic())))
                        pending, seen = self._shown_after(since, resource.plural)
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
            with self.lock:
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
