"""The claim allocator's cache: every ResourceClaim, the devices each node publishes for this
driver, and each DRA node's ledger of the claims allocated there, with the allocations written and not yet
shown by the watch (assumed).

Owned like the extender's cache (``cache.ClusterCache``): the claim and slice informers' threads only put
their changes in an inbox, and the event loop applies them (``apply``) between the allocator's steps; the
allocator reads the cache and assumes what it writes, on the loop too. No lock guards any of it, and none is
held across a call to the API server.

A node's ledger is the same ``Ledger`` the extender places gpu-mem pods with, built from the node's GPU
inventory (its Node annotation, in the cache) and the claims allocated there (``core.dra.allocated``, one
holding per device), and kept until one of them changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from gpushared.contract import GpuInventory, dra
from gpushared.core.dra.allocated import claim_holdings
from gpushared.core.placement.claims.asks import read_pending
from gpushared.core.placement.claims.pods import PodClaimRef, allocated_node, pod_claims
from gpushared.core.shared.bodies import Key, ObjectBody, PodBody, key_of, uid_of, version_of
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.extender.inbox import Inbox, Owner
from gpushared.kube.informer import Informer
from gpushared.kube.rest import Rest

log = logging.getLogger(__name__)


class ClaimCache:
    def __init__(self, *, driver: str = dra.DRIVER, device_class: str = dra.DEVICE_CLASS) -> None:
        self.driver, self.device_class = driver, device_class
        self.inbox: Inbox | None = None
        self.informers: list[Informer[ObjectBody]] = []
        #: namespace -> name -> the claim as last seen (watched, or as a write of ours returned it)
        self.claims: dict[str, dict[str, ObjectBody]] = {}
        #: slice name -> (its node, the device names it publishes for this driver)
        self._slices: dict[str, tuple[str, frozenset[str]]] = {}
        self._published: dict[str, frozenset[str]] | None = None
        #: node -> claims allocated there
        self._on_node: dict[str, set[Key]] = {}
        #: claim UID -> (node, holdings): allocations written that the cache does not show yet
        self.assumed: dict[str, tuple[str, list[Holding]]] = {}
        #: node -> changes to its claims; a ledger is kept per (inventory, change count)
        self._changes: dict[str, int] = {}
        #: changes to the claims allocated on any node: what is worked out from them all is kept until it moves
        self.changes = 0
        self._ledgers: dict[str | tuple[str, str], tuple[GpuInventory, int, Ledger]] = {}
        #: claims whose allocation could not be read: counted, and named in the log once
        self.problems: set[str] = set()
        #: (namespace, name, template?) -> whether a new pod naming it is gated: a claim or template that asks
        #: for this driver's class (and, for a claim, is not allocated yet). Changed on the loop; the webhook
        #: reads ``gating``, a copy made after each drain that changed it (the webhook runs on worker threads)
        self._gating: dict[tuple[str, str, bool], bool] = {}
        self.gating: dict[tuple[str, str, bool], bool] = {}
        self._gating_changed = False
        #: claim UID -> the newest resourceVersion the claim watch showed (never a write's answer): what
        #: kube-scheduler's own claim watch shows about as soon
        self.shown: dict[str, int] = {}
        #: allocations written and waited on (``until_shown``): claim UID -> version, and who waits
        self._waiting: list[tuple[dict[str, int], asyncio.Future[None]]] = []

    # --- the informers -------------------------------------------------------------------------------

    def watch(self, rest: Rest, owner: Owner, *, watch_seconds: int = 60) -> None:
        """Mirror the cluster's ResourceClaims and ResourceSlices into an inbox the owner drains."""
        self.inbox = inbox = Inbox(self._apply, owner)
        self.informers = [
            Informer(
                rest.lister(f"/apis/{dra.API_GROUP}/{dra.API_VERSION}/{plural}", what=plural),
                name=plural,
                handler=inbox.handler(plural),
                watch_seconds=watch_seconds,
            )
            for plural in ("resourceclaims", "resourceslices", "resourceclaimtemplates")
        ]

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.inbox is not None:
            self.inbox.attach(loop)
        for informer in self.informers:
            informer.start()

    def stop(self) -> None:
        for informer in self.informers:
            informer.stop()

    def listed(self) -> bool:
        return all(informer.synced for informer in self.informers)

    def drain(self) -> None:
        if self.inbox is not None:
            self.inbox.drain()
        if self._gating_changed:
            self.gating, self._gating_changed = dict(self._gating), False

    def _apply(self, kind: str, old: Any, new: Any) -> None:
        if kind == "resourceclaims":
            self._saw(old, new)
            self.on_claim(old, new)
        elif kind == "resourceslices":
            self.on_slice(old, new)
        else:
            self.on_template(old, new)

    def on_template(self, old: ObjectBody | None, new: ObjectBody | None) -> None:
        """A ResourceClaimTemplate: whether the claims made from it ask for this driver's class."""
        if old is not None:
            self._gate((*key_of(old), True), None)
        if new is not None:
            spec = (new.get("spec") or {}).get("spec") or {}
            self._gate((*key_of(new), True), read_pending({"spec": spec}, device_class=self.device_class) is not None)

    def _gate(self, key: tuple[str, str, bool], gates: bool | None) -> None:
        if gates is None:
            self._gating.pop(key, None)
        else:
            self._gating[key] = gates
        self._gating_changed = True

    # --- what the informers show ----------------------------------------------------------------------

    def on_claim(self, old: ObjectBody | None, new: ObjectBody | None) -> None:
        if old is not None:
            namespace, name = key_of(old)
            known = self.claims.get(namespace, {}).get(name)
            if known is not None and (new is None or uid_of(known) != uid_of(new)):
                self._drop(known)
            if new is None:
                self._gate((namespace, name, False), None)
        if new is None:
            return
        namespace, name = key_of(new)
        known = self.claims.get(namespace, {}).get(name)
        if known is not None and uid_of(known) == uid_of(new) and version_of(new) < version_of(known):
            return  # older than what a write of ours returned: the watch is behind it, not the claim
        self._drop(known)
        self.claims.setdefault(namespace, {})[name] = new
        self._gate((namespace, name, False), read_pending(new, device_class=self.device_class) is not None)
        node = allocated_node((new.get("status") or {}).get("allocation"))
        if node is not None:
            self._on_node.setdefault(node, set()).add((namespace, name))
            self._changed(node)
        assumed = self.assumed.get(uid_of(new))
        if assumed is not None and node is not None:
            self.assumed.pop(uid_of(new))  # shown: counted from the claim itself now
            self._changed(assumed[0])

    def _drop(self, body: ObjectBody | None) -> None:
        if body is None:
            return
        namespace, name = key_of(body)
        if self.claims.get(namespace, {}).get(name) is body:
            del self.claims[namespace][name]
            if not self.claims[namespace]:
                del self.claims[namespace]
        node = allocated_node((body.get("status") or {}).get("allocation"))
        if node is not None:
            self._on_node.get(node, set()).discard((namespace, name))
            self._changed(node)

    def on_slice(self, old: ObjectBody | None, new: ObjectBody | None) -> None:
        self._published = None
        if old is not None:
            self._slices.pop(str((old.get("metadata") or {}).get("name")), None)
        if new is None:
            return
        spec = new.get("spec") or {}
        node = spec.get("nodeName")
        if spec.get("driver") != self.driver or not isinstance(node, str) or not node:
            return
        names = frozenset(
            str(device.get("name")) for device in (spec.get("devices") or [])[:128] if isinstance(device, dict)
        )
        self._slices[str((new.get("metadata") or {}).get("name"))] = (node, names)

    def published(self) -> dict[str, frozenset[str]]:
        """Node -> the devices its slices of this driver publish: the nodes claims may be allocated on. The
        same objects until a slice changes (readers keep what they derive from them by identity)."""
        if self._published is None:
            found: dict[str, frozenset[str]] = {}
            for node, names in self._slices.values():
                found[node] = found[node] | names if node in found else names
            self._published = found
        return self._published

    def _saw(self, old: ObjectBody | None, new: ObjectBody | None) -> None:
        """The claim watch showed a claim changed (or gone: a gone claim counts as shown to those waiting)."""
        if new is None:
            if old is not None:
                self.shown.pop(uid_of(old), None)
                gone = uid_of(old)
                for versions, future in self._waiting:
                    if gone in versions and not future.done():
                        future.set_result(None)
            return
        uid = uid_of(new)
        self.shown[uid] = max(self.shown.get(uid, 0), version_of(new))
        for versions, future in self._waiting:
            if not future.done() and all(self.shown.get(u, 0) >= v for u, v in versions.items()):
                future.set_result(None)

    async def until_shown(self, versions: dict[str, int], *, within: float) -> bool:
        """Wait until the claim watch shows each claim at least at its version (the allocator's writes), for
        ``within`` seconds at most: whether it did. kube-scheduler told of a pod before its claim watch shows
        the allocation allocates the claim itself, is refused, and tries the pod again seconds later."""
        if all(self.shown.get(uid, 0) >= version for uid, version in versions.items()):
            return True
        entry = (versions, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            async with asyncio.timeout(within):
                await entry[1]
            return True
        except TimeoutError:
            return False
        finally:
            self._waiting.remove(entry)

    # --- what the allocator writes --------------------------------------------------------------------

    def assume(self, uid: str, node: str, holdings: Iterable[Holding]) -> None:
        """Count an allocation being written before the watch shows it (kube-scheduler's AssumePod)."""
        self.assumed[uid] = (node, list(holdings))
        self._changed(node)

    def forget(self, uid: str) -> None:
        """An allocation the API server refused: it never lands."""
        known = self.assumed.pop(uid, None)
        if known is not None:
            self._changed(known[0])

    def written(self, body: ObjectBody) -> None:
        """A claim as a write of ours returned it: what the API server stored, applied at once."""
        namespace, name = key_of(body)
        self.on_claim(self.claims.get(namespace, {}).get(name), body)

    # --- what the allocator reads ---------------------------------------------------------------------

    def gating_of(self, pod: PodBody, namespace: str) -> dict[PodClaimRef, bool | None]:
        """For the webhook (any thread): whether each claim or template the new pod names gates it; None
        where the cache does not hold it (yet)."""
        known = self.gating
        return {ref: known.get((namespace, ref.name, ref.template)) for ref in pod_claims(pod)}

    def claim(self, namespace: str, name: str) -> ObjectBody | None:
        return self.claims.get(namespace, {}).get(name)

    def allocated_on(self, node: str) -> list[ObjectBody]:
        """The claims the watch shows allocated on ``node`` (the allocator's writes it does not show yet are not
        claims of any pod yet)."""
        return [self.claims[ns][name] for ns, name in self._on_node.get(node, ()) if name in self.claims.get(ns, {})]

    def ledger(self, node: str, inventory: GpuInventory, *, assumed: bool = True) -> Ledger:
        """The node's GPUs with the claims allocated there and (``assumed``) those written and not shown by the
        watch yet, kept until one changes. Without them: the node as kube-scheduler may still see it."""
        changes = self._changes.get(node, 0)
        slot = node if assumed else (node, "shown")
        known = self._ledgers.get(slot)
        if known is not None and known[1] == changes and (known[0] is inventory or known[0] == inventory):
            return known[2]
        claims = self.allocated_on(node)
        holdings, problems = claim_holdings(claims, node=node, inventory=inventory, driver=self.driver)
        for problem in problems:
            if problem not in self.problems:
                self.problems.add(problem)
                log.warning("claim allocator: %s", problem)
        if assumed:
            shown = {uid_of(claim) for claim in claims}
            for uid, (where, held) in self.assumed.items():
                if where == node and uid not in shown:
                    holdings.extend(held)
        ledger = Ledger.build(inventory, holdings)
        self._ledgers[slot] = (inventory, changes, ledger)
        return ledger

    def _changed(self, node: str) -> None:
        self._changes[node] = self._changes.get(node, 0) + 1
        self.changes += 1
