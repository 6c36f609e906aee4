"""A mirror of one kind of object, kept current by list + watch, as client-go's informers keep theirs.

A thread lists, then watches from the list's resourceVersion; a watch that ends is resumed from the last
version seen, a 410 Gone (history compacted) or a broken stream is answered by listing again, and the
difference between the old mirror and the new list is handed to the handler as ordinary changes, so a
consumer never misses a deletion that happened while the watch was down. Reads (:meth:`objects`,
:meth:`get`) are snapshots, never network calls.

A watch can also go quiet without ending: an API server or a proxy that keeps the stream open and sends
nothing. Every watch asks the server to end it after ``watch_seconds``, and one that has neither delivered
nor ended ``SILENCE_GRACE`` seconds after that is dead: its read times out and the mirror is listed again
(:meth:`stale` says so meanwhile). A consumer that catches the watch lagging behind what it read from the
API server asks for a relist itself (:meth:`relist`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import urllib3

from gpushared.core.shared.bodies import Key, NodeBody, PodBody, key_of, uid_of, version_of
from gpushared.kube import jsonio
from gpushared.kube.errors import KubeError
from gpushared.kube.locks import INFORMER, RankedLock
from gpushared.kube.rest import REQUEST_TIMEOUT, Lister

log = logging.getLogger(__name__)

#: The kinds of object an informer mirrors, typed once here at the boundary (core.shared.bodies).
B = TypeVar("B", PodBody, NodeBody, dict[str, Any])
#: Called with (old, new): new None is a deletion, old None an addition. Runs on the informer's thread.
Handler = Callable[[B | None, B | None], None]


#: Objects per list page: client-go's default.
PAGE = 500
#: How long past its own timeout a watch may stay silent before it is taken for dead.
SILENCE_GRACE = REQUEST_TIMEOUT


class Informer(Generic[B]):
    """``list_call`` lists and watches one collection (``Rest.lister``)."""

    def __init__(
        self,
        list_call: Lister,
        *,
        name: str,
        field_selector: str | None = None,
        watch_seconds: int = 300,
        relist_seconds: float = 1800.0,
        handler: Handler[B] | None = None,
        transform: Callable[[B], B] | None = None,
    ) -> None:
        self.list_call = list_call
        #: applied to every object before it is kept: a cache that keeps only what it reads stays small
        self.transform: Callable[[B], B] = transform or (lambda obj: obj)
        self.name = name
        self.field_selector = field_selector
        self.watch_seconds = watch_seconds
        self.relist_seconds = relist_seconds
        self.handler: Handler[B] | None = handler
        self._objects: dict[Key, B] = {}
        # Handlers run under this lock; they may take the cache's (a higher rank), never the other way round.
        self._lock = threading.Condition(RankedLock(f"informer {name}", INFORMER))  # type: ignore[arg-type]
        self._synced = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)
        self._response: Any = None
        self.relists = 0
        #: when the informer last heard from the API server: a list, an event, a bookmark, a watch's end
        self._heard = time.monotonic()
        #: why a relist was asked for and has not completed yet
        self._relist_reason: str | None = None
        #: the last watch died silent (no event, bookmark or end past its bound), and none has spoken since:
        #: the mirror is listed again after each, but what changed since the last list is not seen
        self._went_silent = False
        #: watches taken for dead, and relists asked for by a consumer: what the metrics count
        self.silent_watches = 0
        self.lag_relists = 0
        #: objects added, changed or removed so far: equal counts, the same mirror (cheaper than comparing it)
        self.changes = 0

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._end_watch()
        self._thread.join(timeout=2)

    @property
    def synced(self) -> bool:
        return self._synced

    def stale(self) -> str | None:
        """Why this mirror may be behind the API server right now, or None."""
        if self._relist_reason is not None:
            return f"{self.name}: listing again ({self._relist_reason})"
        bound = self.watch_seconds + SILENCE_GRACE
        silent = time.monotonic() - self._heard
        if self._synced and silent > bound:
            return f"{self.name}: the watch has been silent for {silent:.0f} s"
        if self._went_silent:
            return f"{self.name}: the last watch sent nothing for {bound:.0f} s, not even its end; listed again"
        return None

    def relist(self, reason: str) -> None:
        """List again now: the consumer has seen the API server ahead of the watch."""
        if self._relist_reason is None:
            log.warning("%s: %s; listing again", self.name, reason)
            self.lag_relists += 1
            self._relist_reason = reason
        self._end_watch()

    def _end_watch(self) -> None:
        response = self._response
        if response is not None:
            # Closing the response would wait for the reader's lock; shutting the socket ends the read.
            with contextlib.suppress(Exception):
                response.connection.sock.shutdown(socket.SHUT_RDWR)

    def wait_synced(self, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._synced, timeout)

    # --- reads ---------------------------------------------------------------------------------------------

    def objects(self) -> list[B]:
        with self._lock:
            return list(self._objects.values())

    def get(self, namespace: str, name: str) -> B | None:
        with self._lock:
            return self._objects.get((namespace, name))

    def remember(self, obj: B) -> None:
        """Take a copy someone fetched or wrote, unless the mirror already has a newer one."""
        with self._lock:
            known = self._objects.get(key_of(obj))
            if known is not None and uid_of(known) == uid_of(obj) and version_of(known) >= version_of(obj):
                return
            self._set(self.transform(obj))

    # --- the thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                version = self._list()
                backoff = 0.5
                listed_at = time.monotonic()
                while (
                    not self._stop.is_set()
                    and self._relist_reason is None
                    and time.monotonic() - listed_at < self.relist_seconds
                ):
                    version = self._watch(version)
                continue
            except KubeError as exc:
                log.warning("%s: %s; retrying in %.1fs", self.name, exc, backoff)
            except _Expired:
                log.info("%s: watch expired (410); listing again", self.name)
                continue
            except Exception as exc:  # a cut stream, a bad chunk, a silent watch: list again
                if self._stop.is_set():
                    return
                if self._relist_reason is not None:
                    continue  # asked for: list at once
                if time.monotonic() - self._heard >= self.watch_seconds + SILENCE_GRACE:
                    self._went_silent = True
                    self.silent_watches += 1
                log.warning("%s: watch broke (%s: %s); listing again", self.name, type(exc).__name__, exc)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)

    def _call(self, timeout: urllib3.Timeout, **query: str) -> urllib3.BaseHTTPResponse:
        if self.field_selector:
            query["fieldSelector"] = self.field_selector
        return self.list_call(query, timeout)

    def _list(self) -> str:
        """Everything, in pages (as client-go lists): each page is parsed and transformed before the next
        is read, so a cache of 150k pods never holds them all whole at once."""
        items: dict[Key, B] = {}
        token = ""
        reason = self._relist_reason
        while True:
            response = self._call(
                urllib3.Timeout(REQUEST_TIMEOUT), limit=str(PAGE), **({"continue": token} if token else {})
            )
            try:
                listing = jsonio.loads(response.data)
            finally:
                response.release_conn()
            for obj in listing.get("items") or []:
                items[key_of(obj)] = self.transform(obj)
            token = listing.get("metadata", {}).get("continue") or ""
            if not token:
                break
        with self._lock:
            old = self._objects
            self._objects = dict(items)
            changes: list[tuple[B | None, B | None]]
            changes = [(old.get(k), None) for k in old.keys() - items.keys()]
            changes += [(old.get(k), obj) for k, obj in items.items() if old.get(k) != obj]
            for before, after in changes:
                self._notify(before, after)
            self._synced = True
            self.relists += 1
            self._heard = time.monotonic()
            if self._relist_reason is reason:
                self._relist_reason = None
            self._lock.notify_all()
        return str(listing["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        started = time.monotonic()
        response = self._call(
            urllib3.Timeout(connect=REQUEST_TIMEOUT, read=self.watch_seconds + SILENCE_GRACE),
            watch="true",
            resourceVersion=version,
            timeoutSeconds=str(self.watch_seconds),
            allowWatchBookmarks="true",
        )
        self._response = response
        if self._relist_reason is not None:
            self._end_watch()  # asked for while this watch was being opened
        try:
            buffer = b""
            for chunk in response.stream(amt=None, decode_content=False):
                self._heard = time.monotonic()
                self._went_silent = False
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        version = self._apply(jsonio.loads(line), version)
        finally:
            self._response = None
            response.release_conn()
        self._heard = time.monotonic()  # ended by the server: it is alive
        self._went_silent = False
        if time.monotonic() - started < 1 and not self._stop.is_set():
            time.sleep(0.2)  # a server that ends watches at once must not make us spin
        return version

    def _apply(self, event: dict[str, Any], version: str) -> str:
        kind = event.get("type")
        obj: Any = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise KubeError(f"watch error: {obj.get('message')}", status=obj.get("code"))
        if kind == "BOOKMARK":
            return str(obj.get("metadata", {}).get("resourceVersion", version))
        with self._lock:
            if kind == "DELETED":
                known = self._objects.get(key_of(obj))
                if known is not None and uid_of(known) == uid_of(obj):
                    del self._objects[key_of(obj)]
                    self._notify(known, None)
            else:
                self._set(self.transform(obj))
            self._lock.notify_all()
        return str(obj.get("metadata", {}).get("resourceVersion", version))

    def _set(self, obj: B) -> None:
        old = self._objects.get(key_of(obj))
        self._objects[key_of(obj)] = obj
        self._notify(old, obj)

    def _notify(self, old: B | None, new: B | None) -> None:
        self.changes += 1
        if self.handler is None:
            return
        try:
            self.handler(old, new)
        except Exception:
            log.exception("%s: handler failed", self.name)


class _Expired(Exception):
    pass
