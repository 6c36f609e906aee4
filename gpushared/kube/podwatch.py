"""The pods bound to one node, kept current by list + watch scoped with ``spec.nodeName``.

Scoping matters: Aliyun's device plugin listed every pod in the cluster on each Allocate and overloaded
API servers. One list and one watch per node cost the API server almost nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any, cast

from gpushared.kube.api import REQUEST_TIMEOUT, Api, KubeError

log = logging.getLogger(__name__)


class PodWatch:
    """A thread that mirrors the node's pods; :meth:`pods` is a snapshot, never a network call."""

    def __init__(self, api: Api, node: str, *, watch_seconds: int = 300) -> None:
        self.api = api
        self.node = node
        self.watch_seconds = watch_seconds
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> pod
        self._lock = threading.Condition()
        self._synced = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        self._response: Any = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Closing the response would wait for the reader's lock; shutting the socket ends the read.
            with contextlib.suppress(Exception):
                response.connection.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2)

    @property
    def synced(self) -> bool:
        return self._synced

    def wait_synced(self, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._synced, timeout)

    def pods(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._pods.values())

    def find(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._pods.get((namespace, name))

    def remember(self, pod: dict[str, Any]) -> None:
        """Take a fresher copy fetched or patched by someone else, unless the watch already has newer."""
        if (pod.get("spec") or {}).get("nodeName") != self.node:
            return
        with self._lock:
            known = self._pods.get(_key(pod))
            if known is None or _uid(known) != _uid(pod) or _rv(known) <= _rv(pod):
                self._pods[_key(pod)] = pod

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                version = self._list()
                backoff = 0.5
                while not self._stop.is_set():
                    version = self._watch(version)
            except KubeError as exc:
                log.warning("pod watch on node %s: %s; retrying in %.1fs", self.node, exc, backoff)
            except _Expired:
                log.info("pod watch on node %s expired; listing again", self.node)
                continue
            except Exception as exc:  # a cut stream, a bad chunk: relist
                if self._stop.is_set():
                    return
                log.warning("pod watch on node %s broke (%s: %s); listing again", self.node, type(exc).__name__, exc)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)

    def _list(self) -> str:
        listing = self.api.list_pods_on_node(self.node)
        with self._lock:
            self._pods = {_key(p): p for p in listing.get("items") or []}
            self._synced = True
            self._lock.notify_all()
        return str(listing["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        started = time.monotonic()
        response: Any = cast(Any, self.api.core).list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}",
            watch=True,
            resource_version=version,
            timeout_seconds=self.watch_seconds,
            allow_watch_bookmarks=True,
            _preload_content=False,
            _request_timeout=(REQUEST_TIMEOUT, self.watch_seconds + REQUEST_TIMEOUT),
        )
        self._response = response
        try:
            buffer = b""
            for chunk in response.stream(amt=None, decode_content=False):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        version = self._apply(json.loads(line), version)
        finally:
            self._response = None
            response.release_conn()
        if time.monotonic() - started < 1 and not self._stop.is_set():
            time.sleep(0.2)  # a server that ends watches at once must not make us spin
        return version

    def _apply(self, event: dict[str, Any], version: str) -> str:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise KubeError(f"watch error: {obj.get('message')}", status=obj.get("code"))
        meta = obj.get("metadata") or {}
        if kind == "BOOKMARK":
            return str(meta.get("resourceVersion", version))
        with self._lock:
            if kind == "DELETED":
                if _uid(self._pods.get(_key(obj)) or {}) == _uid(obj):
                    del self._pods[_key(obj)]
            else:
                self._pods[_key(obj)] = obj
            self._lock.notify_all()
        return str(meta.get("resourceVersion", version))


class _Expired(Exception):
    pass


def _rv(pod: dict[str, Any]) -> int:
    text = (pod.get("metadata") or {}).get("resourceVersion", "0")
    return int(text) if str(text).isdigit() else 0


def _key(pod: dict[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


def _uid(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid", ""))
