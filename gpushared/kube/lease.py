"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

Only the leader may bind, so two extender replicas never place two pods on the same free memory from two
different caches. A replica takes the Lease when its holder has not renewed it for ``lease_seconds`` *as
observed on this replica's clock* (the times written in the Lease are never compared across machines), by
a write guarded with the Lease's resourceVersion: of two replicas that try at once, one gets 409. A leader
that cannot renew within ``renew_deadline`` stops leading before anyone else may start.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from gpushared.kube.errors import Conflict, NotFound
from gpushared.kube.rest import Rest, quoted

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        rest: Rest,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float = 15.0,
        renew_deadline: float = 10.0,
        retry_seconds: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[], bool] = lambda: True,
        on_lead: Callable[[], None] = lambda: None,
    ) -> None:
        """``alive``: whether the process can still serve what leading means (the extender: its event loop
        answers). While it says no, the Lease is neither taken nor renewed, so a replica whose verbs hang
        lets it pass to another within one lease duration instead of keeping followers forwarding to it."""
        self.rest = rest
        self.alive = alive
        #: called on the election thread each time this replica takes the Lease (not when it renews it)
        self.on_lead = on_lead
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_deadline = renew_deadline
        self.retry_seconds = retry_seconds
        self.clock = clock
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._renewed_at: float | None = None  # when we last renewed, while leading
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self.transitions = 0

    @property
    def leading(self) -> bool:
        renewed = self._renewed_at
        return renewed is not None and self.clock() - renewed < self.renew_deadline

    @property
    def held(self) -> bool:
        """Whether some replica holds the Lease: it names a holder whose renewals this replica saw within
        the lease's duration."""
        return bool(self.holder) and self.clock() - self._observed_at < self.lease_seconds

    @property
    def holder(self) -> str:
        return self._observed[0] if self._observed else ""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop, and give the Lease up so another replica need not wait for it to expire."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.leading:
            self._renewed_at = None
            try:
                lease = self._read()
                if lease is not None and lease["spec"].get("holderIdentity") == self.identity:
                    lease["spec"].update(holderIdentity="", leaseDurationSeconds=1)
                    self._call("release", "PUT", lease)
            except Exception as exc:
                log.warning("could not release the lease: %s", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._try()
            except Exception as exc:
                log.warning("leader election: %s", exc)
            if self._renewed_at is not None and not self.leading:
                log.error("lost the lease %s/%s: stopped leading", self.namespace, self.name)
                self._renewed_at = None
            self._stop.wait(self.retry_seconds)

    def _call(self, verb: str, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One call on the Lease (a create goes to its collection); 5 s: a renewal cannot wait longer."""
        collection = f"/apis/coordination.k8s.io/v1/namespaces/{quoted(self.namespace)}/leases"
        path = collection if method == "POST" else f"{collection}/{quoted(self.name)}"
        what = f"{verb} lease {self.namespace}/{self.name}"
        return cast(dict[str, Any], self.rest.request(what, method, path, body=body, timeout=5))

    def _read(self) -> dict[str, Any] | None:
        try:
            return self._call("read", "GET")
        except NotFound:
            return None

    def _try(self) -> None:
        if not self.alive():
            if self._renewed_at is not None:
                log.error("not renewing the lease %s/%s: this replica is not answering", self.namespace, self.name)
            return
        lease = self._read()
        if lease is None:
            self._create()
            return
        spec = lease.setdefault("spec", {})
        record = (spec.get("holderIdentity") or "", str(spec.get("renewTime") or ""))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        mine = record[0] == self.identity
        duration = spec.get("leaseDurationSeconds") or self.lease_seconds
        expired = not record[0] or self.clock() - self._observed_at >= duration
        if not mine and not expired:
            return
        now = _now()
        if not mine:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = (spec.get("leaseTransitions") or 0) + 1
        spec.update(holderIdentity=self.identity, leaseDurationSeconds=int(self.lease_seconds), renewTime=now)
        sent = self.clock()
        try:  # the resourceVersion in the body makes this a compare-and-swap
            self._call("renew", "PUT", lease)
        except Conflict:
            return  # another replica wrote first
        self._took(sent, was_mine=mine)

    def _create(self) -> None:
        now = _now()
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.lease_seconds),
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            },
        }
        sent = self.clock()
        try:
            self._call("create", "POST", body)
        except Conflict:
            return
        self._took(sent, was_mine=False)

    def _took(self, sent: float, *, was_mine: bool) -> None:
        if not was_mine:
            self.transitions += 1
            log.info("now leading (lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
            try:
                self.on_lead()
            except Exception:
                log.exception("taking the lease %s/%s: on_lead failed", self.namespace, self.name)
        self._renewed_at = sent  # the time the write was sent: conservative when the answer was slow
