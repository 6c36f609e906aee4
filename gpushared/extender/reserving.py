"""The book of binds counted before the pod watch shows them, and what ends each (``core.placement.reservations``
decides).

A bind counts its pod on the chosen node before it writes the Binding (``cache.ClusterCache.reserve``), and
the count outlives the write until evidence says where the pod is: the watch showing it (``seen``), or a
read-back of the pod (``due`` hands out the reservations to read, ``settle`` applies what was read). A
Binding the API server refused is taken back at once (``forget``); one whose answer was lost stays counted
under a key of its own (``unanswered``). This book says which pods are reserved and under which keys; the
cache, its owner, counts and uncounts them in the state as the book's answers say.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpushared.core.placement.reservations import (
    CHECK_SECONDS,
    CONFIRM_SECONDS,
    FENCE_SECONDS,
    LANDING_SECONDS,
    Action,
    Assumed,
    Settlement,
    fenced,
    settle,
)
from gpushared.core.shared.bodies import PodBody, awaits_node, node_of, uid_of

log = logging.getLogger(__name__)


class Reservations:
    def __init__(
        self,
        *,
        clock: Callable[[], float],
        landing_seconds: float = LANDING_SECONDS,
        fence_seconds: float = FENCE_SECONDS,
    ) -> None:
        self.clock = clock
        #: how long after it was sent a Binding whose answer was lost may still land
        self.landing_seconds = landing_seconds
        #: how long after a start or a takeover a predecessor's Binding may still be applied
        self.fence_seconds = fence_seconds
        #: binds the watch has not shown yet, by the key they are counted under (``Assumed.key``)
        self._assumed: dict[str, Assumed] = {}
        #: pod uid -> the keys of its unanswered Bindings (rare: only after an API server fault)
        self._unanswered: dict[str, set[str]] = {}
        #: when the pod watch was last caught lagging behind a read-back (None: never)
        self._lag_seen: float | None = None
        #: binds are fenced until then while pods in doubt remain (``reservations.fenced``)
        self._fence_until = 0.0
        #: UIDs of the pods waiting for a node when the fence was armed, not seen bound or gone since
        self._in_doubt: set[str] = set()

    # --- the fence ------------------------------------------------------------------------------------

    def arm_fence(self, doubtful: set[str], *, since: float | None = None) -> int:
        """After a start or a takeover: fence binds until ``fence_seconds`` after ``since`` (when an
        earlier extender may have sent its last Binding: this process's start, or now at a takeover)
        while any pod of ``doubtful`` (UIDs of unbound pods that it could have placed) stays unbound; how
        many."""
        self._in_doubt = set(doubtful)
        self._fence_until = (self.clock() if since is None else since) + self.fence_seconds
        if self._in_doubt:
            log.warning(
                "binds fenced for up to %.0f s: %d pods were waiting for a node, and an earlier extender may "
                "have their Bindings in flight",
                self.fence_seconds,
                len(self._in_doubt),
            )
        return len(self._in_doubt)

    def fenced(self, uid: str | None = None) -> str | None:
        """Why a bind of pod ``uid`` must wait now (``reservations.fenced``), or None; the pod's own doubt
        does not hold its own bind."""
        now = self.clock()
        if self._in_doubt and now >= self._fence_until:
            self._in_doubt.clear()
        others = len(self._in_doubt) - (uid in self._in_doubt)
        return fenced(now=now, until=self._fence_until, in_doubt=others)

    def in_doubt(self) -> int:
        """Pods whose Bindings an earlier extender may have in flight, while binds are fenced for them."""
        return 0 if self.fenced() is None else len(self._in_doubt)

    # --- binds ----------------------------------------------------------------------------------------

    def assumed(self, uid: str) -> Assumed | None:
        """The bind of the pod that the watch has not shown yet, if any."""
        return self._assumed.get(uid)

    def holds(self, uid: str) -> bool:
        """Whether a bind counts the pod that the watch has not shown bound yet."""
        return uid in self._assumed

    def assume(self, uid: str, namespace: str, name: str, node: str) -> None:
        now = self.clock()
        self._assumed[uid] = Assumed(uid, namespace, name, node, since=now, check_at=now + CONFIRM_SECONDS)

    def forget(self, uid: str, node: str) -> bool:
        """A Binding to ``node`` the API server refused: whether its reservation was here to drop."""
        known = self._assumed.get(uid)
        if known is None or known.node != node:
            return False
        del self._assumed[uid]
        return True

    def unanswered(self, uid: str, node: str) -> Assumed | None:
        """A Binding to ``node`` whose answer was lost: its reservation moves to a key of its own (returned
        as ``Assumed.key``), read back at once; None when there is none to move."""
        known = self._assumed.get(uid)
        if known is None or known.node != node:
            return None
        del self._assumed[uid]
        known.unanswered, known.check_at = True, self.clock()
        self._assumed[known.key] = known
        self._unanswered.setdefault(uid, set()).add(known.key)
        log.warning("%s: no answer; its memory stays reserved until the pod is read back", known.describe())
        return known

    def seen(self, old: PodBody | None, new: PodBody | None) -> list[str]:
        """A pod event: a pod seen bound, deleted or re-created needs none of its reservations any more (a
        bound pod refuses every other Binding, and a deleted one every one). Returns the keys of unanswered
        Bindings that must no longer be counted."""
        gone: list[str] = []
        if old is not None and (new is None or uid_of(old) != uid_of(new)):
            gone += self.settled(uid_of(old))
            self._in_doubt.discard(uid_of(old))
        if new is not None and node_of(new):
            gone += self.settled(uid_of(new))
        if new is not None and not awaits_node(new):
            self._in_doubt.discard(uid_of(new))
        return gone

    def settled(self, uid: str) -> list[str]:
        """The pod's reservations end; the keys of its unanswered Bindings, no longer to be counted."""
        self._assumed.pop(uid, None)
        keys = list(self._unanswered.pop(uid, ()))
        for key in keys:
            self._assumed.pop(key, None)
        return keys

    # --- read-backs -----------------------------------------------------------------------------------

    def due(self, *, limit: int) -> list[Assumed]:
        """Reservations to read back now: binds the watch has not confirmed within CONFIRM_SECONDS, and
        unanswered Bindings; each is handed out again only CHECK_SECONDS later."""
        now = self.clock()
        found = [assumed for assumed in self._assumed.values() if assumed.check_at <= now][:limit]
        for assumed in found:
            assumed.check_at = now + CHECK_SECONDS
        return found

    def settle(self, assumed: Assumed, read: PodBody | None) -> Settlement | None:
        """What a read-back of the pod (None: 404) means for its reservation (``reservations.settle``); None
        when the watch settled it meanwhile. A reservation released is gone from the book when this
        returns; one the API server shows bound stays until the cache counts the pod (``settled``)."""
        if self._assumed.get(assumed.key) is not assumed:
            return None
        outcome = settle(assumed, read, now=self.clock(), landing=self.landing_seconds)
        if outcome.action is Action.RELEASE:
            del self._assumed[assumed.key]
            if assumed.unanswered:
                keys = self._unanswered.get(assumed.uid, set())
                keys.discard(assumed.key)
                if not keys:
                    self._unanswered.pop(assumed.uid, None)
        if outcome.action is not Action.WAIT:
            log.info("%s", outcome.reason)
        return outcome

    def lagging(self) -> bool:
        """Evidence that the pod watch is behind the API server was found: whether to list again now (at
        most once per CHECK_SECONDS)."""
        now = self.clock()
        if self._lag_seen is None or now - self._lag_seen >= CHECK_SECONDS:
            self._lag_seen = now
            return True
        return False

    def unconfirmed(self) -> int:
        """Binds counted that neither the watch nor a read-back has confirmed yet."""
        return len(self._assumed)
