"""The daemon's API writes on the Allocate path, done later on a thread of their own.

The kubelet waits on Allocate, and an Allocate that waited on the API server would hold every admission
on the node while the API server is slow (the kubelet admits pods one at a time). So what Allocate has to
tell the cluster — a pod's ASSIGNED flag, its Events — is queued here and written in the background, each
write retried with back-off while the API server fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from gpushared import contract
from gpushared.core.shared.bodies import PodBody, meta_of
from gpushared.kube.api import Api, KubeError, NotFound
from gpushared.kube.podwatch import PodWatch

log = logging.getLogger(__name__)

COMPONENT = "gpushared"
#: Tries of one write; the waits between them double from 0.2 s up to 5 s (about 11 s in all).
ATTEMPTS = 6


class Outbox:
    def __init__(self, api: Api | None, pods: PodWatch | None, *, clock: Callable[[], int] = time.time_ns) -> None:
        self.api = api
        self.pods = pods
        self.clock = clock
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="api-writes", daemon=True)
        self._writer.start()

    def event(self, pod: PodBody, reason: str, message: str, *, warning: bool) -> None:
        """Record an Event on the pod, later."""
        self._queue.put(lambda: self._event(pod, reason, message, warning=warning))

    def mark_assigned(self, pod: PodBody) -> None:
        """Set the pod's ALIYUN_COM_GPU_MEM_ASSIGNED (and a fresh assume time), later."""
        self._queue.put(lambda: self._mark_assigned(pod))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def _write_loop(self) -> None:
        while True:
            write = self._queue.get()
            try:
                for attempt in range(ATTEMPTS):
                    try:
                        write()
                        break
                    except KubeError as exc:
                        log.warning("API write failed (%s); attempt %d", exc, attempt + 1)
                        time.sleep(min(0.2 * 2**attempt, 5.0))
            except Exception:
                log.exception("API write failed")
            finally:
                self._queue.task_done()

    def _mark_assigned(self, pod: PodBody) -> None:
        if self.api is None:
            return
        meta = meta_of(pod)
        patch = {
            "metadata": {
                "annotations": {
                    contract.ALIYUN_GPU_MEM_ASSIGNED: contract.format_bool(True),
                    contract.ALIYUN_GPU_MEM_ASSUME_TIME: str(self.clock()),
                }
            }
        }
        try:
            updated = self.api.patch_pod(meta.get("namespace", ""), meta.get("name", ""), patch)
        except NotFound:
            return  # deleted meanwhile
        if self.pods is not None:
            self.pods.remember(updated)

    def _event(self, pod: PodBody, reason: str, message: str, *, warning: bool) -> None:
        if self.api is None:
            return
        try:
            self.api.pod_event(pod, reason=reason, message=message, warning=warning, component=COMPONENT)
        except KubeError as exc:
            if exc.status in (403, 404, 409, 422):
                log.warning("event on pod not written: %s", exc)
                return
            raise
