"""The claim allocator's writes to the API server: a claim's allocation, written as kube-scheduler writes it and
guarded by the resourceVersion the allocator decided from; a pod's gate, removed with a JSON Patch that tests
the pod's UID and the gate's place; an allocation released. Each is one call (the gate at most two, when the
pod's gates moved meanwhile), on the extender's event loop, holding nothing.

A write the API server refuses for want of a permission is not a conflict to try again at the next step: the
same write is refused every time until an operator grants it. ``Refusals`` keeps it: the allocator writes
nothing for ``REFUSED_RETRY_SECONDS`` after one, says so loudly (an error in the log, an Event on each waiting
pod, a metric, ``/readyz/claim-allocator``), and tries one write again after that.
"""

from __future__ import annotations

import datetime
import enum
import logging
import re
import uuid
from typing import Any

from gpushared.contract import dra
from gpushared.core.dra.allocation import GivenDevice, allocation_body
from gpushared.core.placement.claims.asks import ClaimAsk
from gpushared.core.placement.claims.choice import ClaimChoice
from gpushared.core.placement.claims.gate import CLAIM_GATE
from gpushared.core.shared.bodies import Key, ObjectBody, PodBody, key_of, meta_of, uid_of
from gpushared.extender.cache import ClusterCache
from gpushared.extender.claims.cache import ClaimCache
from gpushared.extender.gatedwork import Patched, patch_pod
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.errors import KubeError

log = logging.getLogger(__name__)

#: How long after the API server refused the allocator a permission it writes nothing, before trying once more.
REFUSED_RETRY_SECONDS = 30.0
#: How long a claim this allocator wrote for a pod that was then deleted stays allocated before it is released:
#: long enough for the watch to show a pod that reserved it.
RELEASE_GRACE_SECONDS = 5.0
#: What the allocator needs, said with each refusal: the RBAC that ships with it grants all of it.
NEEDED = (
    "the claim allocator's ServiceAccount needs update on resourceclaims and resourceclaims/status and, from "
    "Kubernetes 1.36, on "
    "resourceclaims/binding (KEP-4817), and patch on pods (deploy/dra/claim-allocator.yaml, the chart's "
    "dra.claimAllocator)"
)


def refused_permission(exc: KubeError) -> bool:
    """Whether the API server refused a write for want of a permission: 403, or the 422 with a ``Forbidden``
    field error that kube-apiserver 1.36 answers a status write changing ``status.allocation`` or
    ``status.reservedFor`` without ``resourceclaims/binding``."""
    message = str(exc)
    return exc.status == 403 or (exc.status == 422 and ": Forbidden: " in message and "permission" in message)


class Refusals:
    """The last permission the API server refused the allocator, and when: while it stands, nothing is written
    (``holding``) but one write every ``REFUSED_RETRY_SECONDS``."""

    def __init__(self) -> None:
        #: what was refused, as the API server said it; None: nothing refused since the last write that landed
        self.why: str | None = None
        self.at = float("-inf")

    def refused(self, what: str, exc: KubeError, now: float) -> None:
        self.why, self.at = f"{what}: {exc}", now
        log.error("the API server refused the claim allocator %s: %s; %s", what, exc, NEEDED)

    def accepted(self) -> None:
        if self.why is not None:
            log.warning("the API server accepts the claim allocator's writes again")
        self.why = None

    def holding(self, now: float) -> bool:
        return self.why is not None and now - self.at < REFUSED_RETRY_SECONDS

    def reason(self) -> str:
        """What pods waiting are told: the same words for every write refused the same permission."""
        return f"the API server refuses the claim allocator {missing_permission(self.why or '')}; {NEEDED}"


def missing_permission(message: str) -> str:
    """The verb and resource an authorizer's refusal names (``cannot update resource "resourceclaims/binding"``,
    in a 403 and inside 1.36's 422 alike), or "a permission" where it names none."""
    found = _CANNOT.search(message)
    return f"{found.group(1)} on {found.group(2)}" if found else "a permission"


_CANNOT = re.compile(r'cannot (\w+) resource "([^"]+)"')


class Gate(enum.Enum):
    """What became of a pod's gate: removed by this call, absent already, the pod gone, or not removed
    (an error: the pod is decided again at the next step)."""

    REMOVED = "removed"
    ABSENT = "absent"
    GONE = "gone"
    FAILED = "failed"
    #: the API server refused the permission to patch the pod
    REFUSED = "refused"


#: What became of a gate's removal, by what became of its patch.
_GATE_OF = {
    Patched.DONE: Gate.REMOVED,
    Patched.NOTHING: Gate.ABSENT,
    Patched.GONE: Gate.GONE,
    Patched.UNREAD: Gate.FAILED,
    Patched.FAILED: Gate.FAILED,
}


class ClaimWrites:
    def __init__(
        self,
        cache: ClusterCache,
        claim_cache: ClaimCache,
        api: AsyncApi,
        *,
        driver: str,
        class_config: tuple[dict[str, object], ...],
    ) -> None:
        self.cache, self.claim_cache, self.api = cache, claim_cache, api
        self.driver, self.class_config = driver, class_config
        #: the refusal behind the last ``Gate.REFUSED``
        self.refused: KubeError | None = None
        #: the last permission the API server refused (the allocator's, read by its metric and readiness)
        self.refusals = Refusals()
        #: claim UID -> (the pod it was written for, when): released if that pod goes before reserving it
        self.written_for: dict[str, tuple[Key, str, float, ClaimAsk]] = {}

    def left_over(self, now: float) -> list[ObjectBody]:
        """The claims written for a pod that is gone, that no pod reserved (``written_for``): to release."""
        found = []
        for claim_uid, (pod_key, pod_uid, when, ask) in list(self.written_for.items()):
            if now - when < RELEASE_GRACE_SECONDS:
                continue
            pending = self.cache.pending.get(pod_key)
            if pending is not None and uid_of(pending) == pod_uid:
                continue  # still waiting: kube-scheduler reserves it when it binds
            del self.written_for[claim_uid]
            claim = self.claim_cache.claim(ask.namespace, ask.name)
            status = (claim or {}).get("status") or {}
            if claim is None or uid_of(claim) != claim_uid or not status.get("allocation") or status.get("reservedFor"):
                continue
            if self.cache.state.node_of.get(pod_uid) is None:  # bound meanwhile: the kubelet reserves it
                found.append(claim)
        return found

    def allocated_body(self, ask: ClaimAsk, number: int, choice: ClaimChoice) -> ObjectBody | None:
        """The claim with the allocation of its devices, as read (its resourceVersion guards the write)."""
        claim = self.claim_cache.claim(ask.namespace, ask.name)
        if claim is None or str((claim.get("metadata") or {}).get("uid")) != ask.uid:
            return None  # deleted, or made again, since it was decided
        node = self.cache.state.nodes.get(choice.node)
        if node is None or node.inventory is None:
            return None
        unit_bytes = node.inventory.unit.to_bytes(1)
        devices = [
            GivenDevice(p.request, p.device, p.units * unit_bytes, p.compute, str(uuid.uuid4()))
            for p in choice.picks
            if p.claim == number
        ]
        claim_config = ((claim.get("spec") or {}).get("devices") or {}).get("config") or []
        allocation = allocation_body(
            node=choice.node,
            devices=devices,
            class_config=self.class_config,
            claim_config=claim_config,
            driver=self.driver,
            allocated_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        meta = {**(claim.get("metadata") or {}), "resourceVersion": ask.resource_version}
        return {**claim, "metadata": meta, "status": {**(claim.get("status") or {}), "allocation": allocation}}

    async def allocate(self, body: ObjectBody) -> ObjectBody:
        """Write the claim's allocation (``allocated_body``), as kube-scheduler writes one: the finalizer
        ``dra.ALLOCATED_FINALIZER`` first, in a write of the claim itself where it lacks it (so that
        kube-controller-manager deallocates the claim once no pod uses it), then the status. Each write is
        guarded by the resourceVersion the one before left; the claim as stored after the last is returned."""
        meta = body.get("metadata") or {}
        finalizers = list(meta.get("finalizers") or [])
        if dra.ALLOCATED_FINALIZER not in finalizers:
            protected = await self.api.put_claim(
                {**body, "metadata": {**meta, "finalizers": [*finalizers, dra.ALLOCATED_FINALIZER]}}
            )
            body = {**body, "metadata": protected.get("metadata") or {}}
        return await self.api.put_claim_status(body)

    async def remove_gate(self, pod: PodBody) -> Gate:
        """Remove the allocator's gate from the pod, testing its UID and the gate's place. A pod whose gates
        moved meanwhile is read again and tried once more."""

        def operations_of(current: PodBody) -> list[dict[str, Any]] | None:
            gates = (current.get("spec") or {}).get("schedulingGates") or []
            at = next((i for i, g in enumerate(gates) if isinstance(g, dict) and g.get("name") == CLAIM_GATE), None)
            if at is None:
                return None
            return [
                {"op": "test", "path": "/metadata/uid", "value": uid_of(pod)},
                {"op": "test", "path": f"/spec/schedulingGates/{at}/name", "value": CLAIM_GATE},
                {"op": "remove", "path": f"/spec/schedulingGates/{at}"},
            ]

        patch = await patch_pod(self.api, pod, operations_of, read_first=False)
        if patch.outcome is Patched.FAILED and patch.error is not None:
            if refused_permission(patch.error):
                self.refused = patch.error
                return Gate.REFUSED
            log.warning("pod %s/%s: its gate was not removed (tried again): %s", *key_of(pod), patch.error)
        return _GATE_OF[patch.outcome]

    async def release(self, claim: ObjectBody) -> bool:
        """Remove the claim's allocation, guarded by the resourceVersion it was read at: whether it was."""
        status = {k: v for k, v in (claim.get("status") or {}).items() if k not in ("allocation", "devices")}
        try:
            written = await self.api.put_claim_status({**claim, "status": status})
        except KubeError as exc:
            if refused_permission(exc):
                log.error(
                    "claim %s not released, the API server refused it: %s; %s", meta_of(claim).get("name"), exc, NEEDED
                )
            else:
                log.info("claim %s not released (changed since): %s", meta_of(claim).get("name"), exc)
            return False
        self.claim_cache.written(written)
        return True
