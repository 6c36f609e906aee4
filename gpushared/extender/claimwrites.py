"""The claim allocator's writes to the API server (issue #54): a claim's allocation, written as kube-scheduler
writes it and guarded by the resourceVersion the allocator decided from; a pod's gate, removed with a JSON
Patch that tests the pod's UID and the gate's place; an allocation released. Each is one call (the gate at
most two, when the pod's gates moved meanwhile), on the extender's event loop, holding nothing.
"""

from __future__ import annotations

import enum
import logging
import uuid

from gpushared.core.dra.allocation import GivenDevice, allocation_body
from gpushared.core.placement.admission import CLAIM_GATE
from gpushared.core.placement.claimchoice import ClaimChoice
from gpushared.core.placement.claims import ClaimAsk
from gpushared.core.shared.bodies import PodBody, key_of, meta_of, uid_of
from gpushared.extender.cache import ClusterCache
from gpushared.extender.claimbook import Body, ClaimBook
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.errors import KubeError

log = logging.getLogger(__name__)


class Gate(enum.Enum):
    """What became of a pod's gate: removed by this call, absent already, the pod gone, or not removed
    (an error: the pod is decided again at the next step)."""

    REMOVED = "removed"
    ABSENT = "absent"
    GONE = "gone"
    FAILED = "failed"


class ClaimWrites:
    def __init__(
        self,
        cache: ClusterCache,
        book: ClaimBook,
        api: AsyncApi,
        *,
        driver: str,
        class_config: tuple[dict[str, object], ...],
    ) -> None:
        self.cache, self.book, self.api = cache, book, api
        self.driver, self.class_config = driver, class_config

    def allocated_body(self, ask: ClaimAsk, number: int, choice: ClaimChoice) -> Body | None:
        """The claim with the allocation of its devices, as read (its resourceVersion guards the write)."""
        claim = self.book.claim(ask.namespace, ask.name)
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
        )
        meta = {**(claim.get("metadata") or {}), "resourceVersion": ask.resource_version}
        return {**claim, "metadata": meta, "status": {**(claim.get("status") or {}), "allocation": allocation}}

    async def remove_gate(self, pod: PodBody) -> Gate:
        """Remove the allocator's gate from the pod, testing its UID and the gate's place. A pod whose gates
        moved meanwhile is read again and tried once more."""
        namespace, name = key_of(pod)
        uid = uid_of(pod)
        for _ in range(2):
            gates = (pod.get("spec") or {}).get("schedulingGates") or []
            at = next((i for i, g in enumerate(gates) if isinstance(g, dict) and g.get("name") == CLAIM_GATE), None)
            if at is None:
                return Gate.ABSENT
            operations = [
                {"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "test", "path": f"/spec/schedulingGates/{at}/name", "value": CLAIM_GATE},
                {"op": "remove", "path": f"/spec/schedulingGates/{at}"},
            ]
            try:
                await self.api.json_patch_pod(namespace, name, operations)
                return Gate.REMOVED
            except KubeError as exc:
                if exc.status == 404:
                    return Gate.GONE
                if exc.status not in (409, 422):
                    log.warning("pod %s/%s: its gate was not removed (tried again): %s", namespace, name, exc)
                    return Gate.FAILED
            try:
                pod = await self.api.get_pod(namespace, name)
            except KubeError as exc:
                return Gate.GONE if exc.status == 404 else Gate.FAILED
            if uid_of(pod) != uid:
                return Gate.GONE  # deleted and made again: not the pod decided
        return Gate.FAILED

    async def release(self, claim: Body) -> bool:
        """Remove the claim's allocation, guarded by the resourceVersion it was read at: whether it was."""
        status = {k: v for k, v in (claim.get("status") or {}).items() if k not in ("allocation", "devices")}
        try:
            written = await self.api.put_claim_status({**claim, "status": status})
        except KubeError as exc:
            log.info("claim %s not released (changed since): %s", meta_of(claim).get("name"), exc)
            return False
        self.book.written(written)
        return True
