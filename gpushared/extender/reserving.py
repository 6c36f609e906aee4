"""Binds counted before the pod watch shows them, and what ends that count (``reservations`` decides).

``reserve`` judges the node again, takes the policy's GPUs and counts the pod there in one hold of the
lock, so two binds to one node always see each other. The count then outlives the Binding's write until
evidence says where the pod is: the watch showing it (``seen``), or a read-back of the pod (``due`` hands
out the reservations to read, ``settle`` applies what was read). A Binding the API server refused is taken
back at once (``forget``); one whose answer was lost stays counted under a key of its own (``unanswered``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from gpushared.contract import GpuInfo, MemoryUnit
from gpushared.core.binding import bind_annotations
from gpushared.core.bodies import PodBody, annotations_of, awaits_node, key_of, meta_of, node_of, slim_pod, uid_of
from gpushared.core.policies import Policy
from gpushared.core.requests import PodRequest
from gpushared.core.verdicts import explain
from gpushared.extender.index import FilterIndex
from gpushared.extender.reservations import (
    CHECK_SECONDS,
    CONFIRM_SECONDS,
    LANDING_SECONDS,
    Action,
    Assumed,
    Settlement,
    fenced,
    settle,
)
from gpushared.extender.state import ClusterState, Rejected

log = logging.getLogger(__name__)


class Reservation(NamedTuple):
    """A bind's choice, counted in the cache: the GPUs, the annotations that record them, their unit."""

    gpus: list[GpuInfo]
    annotations: dict[str, str]
    unit: MemoryUnit


class Reservations:
    def __init__(
        self,
        state: ClusterState,
        index: FilterIndex,
        *,
        watch_lags: Callable[[str], None],
        landing_seconds: float = LANDING_SECONDS,
    ) -> None:
        self.state = state
        self.index = index
        #: told why, when a read-back shows the pod watch behind the API server (the watch lists again)
        self.watch_lags = watch_lags
        #: how long after it was sent a Binding whose answer was lost may still land
        self.landing_seconds = landing_seconds
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

    def arm_fence(self, doubtful: set[str]) -> int:
        """After a start or a takeover: fence binds for the landing window while any pod of ``doubtful``
        (UIDs of pods waiting for a node that an earlier extender could have placed) stays unbound; returns
        how many are in doubt."""
        with self.state.lock:
            self._in_doubt = {uid for uid in doubtful if uid not in self.state.node_of}
            self._fence_until = self.state.clock() + self.landing_seconds
            if self._in_doubt:
                log.warning(
                    "binds fenced for up to %.0f s: %d pods were waiting for a node, and an earlier extender may "
                    "have their Bindings in flight",
                    self.landing_seconds,
                    len(self._in_doubt),
                )
            return len(self._in_doubt)

    def fenced(self) -> str | None:
        """Why binds must wait now (``reservations.fenced``), or None."""
        with self.state.lock:
            if self._in_doubt and self.state.clock() >= self._fence_until:
                self._in_doubt.clear()
            return fenced(now=self.state.clock(), until=self._fence_until, in_doubt=len(self._in_doubt))

    def in_doubt(self) -> int:
        """Pods whose Bindings an earlier extender may have in flight, while binds are fenced for them."""
        return 0 if self.fenced() is None else len(self._in_doubt)

    def reserve(
        self, name: str, pod: PodBody, request: PodRequest, *, policy: Policy, now_ns: int
    ) -> Reservation | Rejected:
        """Choose the pod's GPUs on node ``name`` with ``policy`` and count the pod there at once, with the
        annotations that record the choice; or say why it cannot go there. One hold of the lock from the
        judgement to the count: two binds to one node never both take the same memory."""
        with self.state.lock:
            known = self._assumed.get(uid_of(pod))
            if known is not None:
                # Its Binding was created and the watch has not shown it yet: a second one would fail, and
                # counting the pod on another node meanwhile would free the memory it holds on the first.
                return Rejected(f"it is already bound to node {known.node} (the watch has not shown it yet)")
            judged = self.index.judge(name, pod, request)
            if isinstance(judged, Rejected):
                return judged
            verdicts, setting = judged
            choice = policy.choose(verdicts, request, setting)
            if choice is None:
                return Rejected(f"it does not fit node {name}: {explain(verdicts, gpus=request.gpus)}")
            inventory = self.state.nodes[name].inventory
            assert inventory is not None  # judged usable above
            gpus = [verdict.gpu for verdict in choice]
            carried = annotations_of(pod)
            annotations = bind_annotations(request, gpus, unit=inventory.unit, now_ns=now_ns, carried=carried.keys())
            annotated: PodBody = {**pod, "metadata": {**meta_of(pod), "annotations": {**carried, **annotations}}}
            self.assume(annotated, name)
            return Reservation(gpus=gpus, annotations=annotations, unit=inventory.unit)

    def assume(self, pod: PodBody, node: str) -> None:
        """Count a pod this extender is binding, until the watch or a read-back shows where it is."""
        slim = slim_pod(pod)  # kept as the watch would keep it; its parts may be shared, so copied, not changed
        bound: PodBody = {**slim, "spec": {**slim.get("spec", {}), "nodeName": node}}
        namespace, name = key_of(bound)
        with self.state.lock:
            now = self.state.clock()
            uid = uid_of(bound)
            self._assumed[uid] = Assumed(uid, namespace, name, node, since=now, check_at=now + CONFIRM_SECONDS)
            self.state.place(bound)

    def forget(self, pod: PodBody, node: str) -> None:
        """A Binding the API server refused: it never lands, so its reservation goes at once."""
        uid = uid_of(pod)
        with self.state.lock:
            known = self._assumed.get(uid)
            if known is not None and known.node == node:
                del self._assumed[uid]
                if self.state.node_of.get(uid) == node:
                    self.state.remove(uid)

    def unanswered(self, pod: PodBody, node: str) -> None:
        """A Binding whose answer was lost (timeout, cut connection, 5xx): it may land yet. Its memory stays
        counted on ``node`` under a key of its own until the pod is read back or seen (``reservations``);
        the pod itself is free to be tried elsewhere meanwhile."""
        uid = uid_of(pod)
        with self.state.lock:
            known = self._assumed.get(uid)
            if known is None or known.node != node or self.state.node_of.get(uid) != node:
                return  # the watch showed the pod already: it is counted where it is
            body = self.state.nodes[node].pods[uid]
            del self._assumed[uid]
            self.state.remove(uid)
            known.unanswered, known.check_at = True, self.state.clock()
            self._assumed[known.key] = known
            self._unanswered.setdefault(uid, set()).add(known.key)
            self.state.place({**body, "metadata": {**meta_of(body), "uid": known.key}})
            log.warning("%s: no answer; its memory stays reserved until the pod is read back", known.describe())

    def holds(self, uid: str) -> bool:
        """Whether a bind counts the pod that the watch has not shown bound yet."""
        return uid in self._assumed

    def seen(self, old: PodBody | None, new: PodBody | None) -> None:
        """A pod event, before the state counts it: a pod seen bound, deleted or re-created needs none of
        its reservations any more (a bound pod refuses every other Binding, and a deleted one every one)."""
        with self.state.lock:
            if old is not None and (new is None or uid_of(old) != uid_of(new)):
                self._settled(uid_of(old))
                self._in_doubt.discard(uid_of(old))
            if new is not None and node_of(new):
                self._settled(uid_of(new))
            if new is not None and not awaits_node(new):
                self._in_doubt.discard(uid_of(new))

    def due(self, *, limit: int) -> list[Assumed]:
        """Reservations to read back now: binds the watch has not confirmed within CONFIRM_SECONDS, and
        unanswered Bindings; each is handed out again only CHECK_SECONDS later."""
        with self.state.lock:
            now = self.state.clock()
            found = [assumed for assumed in self._assumed.values() if assumed.check_at <= now][:limit]
            for assumed in found:
                assumed.check_at = now + CHECK_SECONDS
            return found

    def settle(self, assumed: Assumed, read: PodBody | None, *, shown: PodBody | None) -> Settlement | None:
        """Apply what a read-back of the pod showed (None: 404), beside what the pod watch shows of it now;
        None when the watch settled it meanwhile."""
        with self.state.lock:
            if self._assumed.get(assumed.key) is not assumed:
                return None
            outcome = settle(assumed, read, now=self.state.clock(), landing=self.landing_seconds)
            if outcome.action is Action.WAIT:
                return outcome
            log.info("%s", outcome.reason)
            if outcome.action is Action.COUNT:
                assert read is not None
                if shown is None or uid_of(shown) != assumed.uid or not node_of(shown):
                    self._lagging(f"the pod watch has not shown pod {assumed.namespace}/{assumed.name} bound")
                self._settled(assumed.uid)
                self.state.place(slim_pod(read))
                return outcome
            del self._assumed[assumed.key]
            if assumed.unanswered:
                keys = self._unanswered.get(assumed.uid, set())
                keys.discard(assumed.key)
                if not keys:
                    self._unanswered.pop(assumed.uid, None)
                self.state.remove(assumed.key)
            elif self.state.node_of.get(assumed.uid) == assumed.node:
                self.state.remove(assumed.uid)
            return outcome

    def unconfirmed(self) -> int:
        """Binds counted that neither the watch nor a read-back has confirmed yet."""
        with self.state.lock:
            return len(self._assumed)

    def _settled(self, uid: str) -> None:
        self._assumed.pop(uid, None)
        for key in self._unanswered.pop(uid, ()):
            self._assumed.pop(key, None)
            self.state.remove(key)

    def _lagging(self, why: str) -> None:
        """Evidence that the pod watch is behind the API server: relist, at most once per CHECK_SECONDS."""
        now = self.state.clock()
        if self._lag_seen is None or now - self._lag_seen >= CHECK_SECONDS:
            self._lag_seen = now
            self.watch_lags(why)
