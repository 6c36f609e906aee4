"""The claim allocator's fence: the pods kube-scheduler may be allocating claims of this driver
for, the room the allocator keeps free for them meanwhile, and the pods it counts as having reached
kube-scheduler without the gate.

kube-scheduler allocates first fit the claims of the pods it is given ungated (the webhook skipped or down,
a hand-over, a timeout), and two allocators writing different claims could each take the same GPU's last
room. So for ``KUBE_WINDOW_SECONDS`` after such a pod reached kube-scheduler, the allocator keeps free on
each GPU what the pod's pending claims could take there as kube-scheduler may see the node (the claims the
watch shows, without the allocator's writes it may not show yet), and on each GPU the sum over such pods,
never more than the GPU's free room (``core.placement.claims.room``: kube-scheduler never puts its own pods
past a GPU's capacity). A gated pod is placed where it fits with that room counted; one that fits only in
it waits (``FENCED``). The fence holds room, never whole nodes: a tenant's 1 GiB pods that kube-scheduler
can never place for a reason the fence does not model (a required pod affinity no pod satisfies) but whose
claims fit everywhere keep 1 GiB per pod on each GPU, not every node, and an ordinary pod still fits beside
them.

Bounded, and never starving the gated pods: the fence weighs ``MAX_FENCED_KINDS`` kinds of pod (the same
claims' shape, CPU, memory and node selection: the pods of one kind take the same room each), those with
the pods kube-scheduler was given last; a node's room is worked out again only when its ledger, CPU or
labels, or the pods weighed, changed. A flood of pods can keep all of a GPU's free room, so the fence holds
a gated pod back ``KUBE_WINDOW_SECONDS`` at most in a row: past that it is placed without the room kept, as
a pod past its window is, and the driver's check at prepare (every claim on the GPU counted from the
allocations) stops a GPU going past its memory or compute.

Owned by the allocator, on the extender's event loop, like everything it keeps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from gpushared.core.placement.claims.asks import ClaimAsk, asks_class
from gpushared.core.placement.claims.pods import claim_names, read_pod
from gpushared.core.placement.claims.room import NO_ROOM_KEPT, KeptRoom, Room, could_take, kept_room
from gpushared.core.shared.bodies import Key, PodBody, key_of, uid_of

if TYPE_CHECKING:  # the placer is handed in; the fence sits beside it, not above it
    from gpushared.extender.claims.placing import ClaimPlacer, PodAsk

#: A namespace's claims by name (``ClaimCache.claims``).
Claims = Callable[[str], Mapping[str, Any]]

#: How long after a pod with pending claims of this driver reached kube-scheduler (handed over, or never
#: gated) the allocator keeps free the room its claims could take: kube-scheduler tries a pod within moments
#: of its gate going. Past it (a pod kube-scheduler keeps trying), the driver's check at prepare is what stops
#: a GPU going past its capacity, so one such pod never stops the allocator for good. It is also the longest
#: the fence holds one gated pod back in a row.
KUBE_WINDOW_SECONDS = 10.0
#: Kinds of pod kube-scheduler may be allocating for that the fence weighs, those it was given last: the
#: fence's work is these kinds on the nodes that changed. Pods of further kinds are left to the driver's
#: check at prepare, as pods past the window are.
MAX_FENCED_KINDS = 32
#: Why a pod waits while the fence keeps the room it would fit in.
FENCED = (
    "kube-scheduler may be allocating claims of pods it was given in the room left for the pod; "
    "the allocator waits so that the two never take one GPU between them"
)


class KeptNodeRoom(NamedTuple):
    """One node's room kept, and what it was worked out from."""

    #: the ids and versions of what it read: the node's ledger as kube-scheduler may see it, its CPU, memory
    #: and model, the GPUs its slices publish
    stamp: tuple[Any, ...]
    #: the objects the stamp names by id, kept alive so that no object made since has the same id
    alive: tuple[Any, ...]
    #: what each kind weighed could take of each GPU there
    takes: dict[PodAsk, dict[int, Room]]
    room: dict[int, Room]


class ClaimFence:
    def __init__(
        self,
        claims: Claims,
        placer: ClaimPlacer,
        *,
        device_class: str,
        counts: Counter[str],
        told: Callable[[PodBody], None],
    ) -> None:
        """``counts``: the allocator's, where pods not gated are counted; ``told``: tells such a pod why."""
        self.claims, self.placer, self.device_class = claims, placer, device_class
        self.counts, self.told = counts, told
        #: pods kube-scheduler may be allocating claims of this driver for (ungated, claims pending), with their
        #: pending asks and the node an allocated claim fixes
        self.kube_allocating: dict[Key, tuple[PodBody, tuple[ClaimAsk, ...], str | None]] = {}
        #: the room kept this step (``hold``): node -> GPU -> room
        self.kept: KeptRoom = NO_ROOM_KEPT
        #: the kinds weighed at the last ``hold``, and how many pods of each
        self._weighed: dict[PodAsk, int] = {}
        #: node -> its room as last worked out (``KeptNodeRoom``)
        self._rooms: dict[str, KeptNodeRoom] = {}
        #: pod UID -> when it reached kube-scheduler with pending claims of this driver
        self.handed_at: dict[str, float] = {}
        #: gated pod UID -> since when the fence holds it back, without a break
        self.held_since: dict[str, float] = {}
        #: UIDs of ungated pods seen with claims of this driver the allocator did not ungate: counted once
        self.not_gated: set[str] = set()
        #: UIDs of pods whose gate the allocator removed (bounded): never counted as not gated
        self.passed: set[str] = set()
        #: UIDs of the pods waiting when this replica began to lead: one its predecessor ungated is not counted
        self.known_before: set[str] = set()

    def began_leading(self, waiting: Iterable[PodBody]) -> None:
        self.known_before = {uid_of(pod) for pod in waiting}

    def passed_by_us(self, uid: str) -> None:
        self.passed.add(uid)
        clear_if_over(self.passed)

    def clear(self) -> None:
        self.kube_allocating.clear()

    def look_at(self, key: Key, pod: PodBody, now: float, *, gated_before: bool) -> None:
        """An ungated pending pod that uses claims: kept while kube-scheduler may be allocating its claims of
        this driver (pending, within the window). One that reached kube-scheduler ungated without the
        allocator having gated it (``gated_before``) or ungated it (the webhook skipped, or down) is counted
        once and told why, never refused: kube-scheduler allocates it first fit, the driver checks at prepare.
        It is counted also when kube-scheduler allocated its claims before the allocator saw it."""
        namespace = key_of(pod)[0]
        claims = self.claims(namespace)
        uid = uid_of(pod)
        known = gated_before or any(uid in seen for seen in (self.not_gated, self.passed, self.known_before))
        if not known and self._uses_ours(pod, claims):
            self.not_gated.add(uid)
            clear_if_over(self.not_gated)
            self.counts["not_gated"] += 1
            self.told(pod)
        read = read_pod(pod, claims, device_class=self.device_class)
        if read.asks and now - self.handed_at.setdefault(uid, now) < KUBE_WINDOW_SECONDS:
            self.kube_allocating[key] = (pod, read.asks, read.node)

    def hold(self) -> None:
        """Work out the room kept this step (``kept``) from the pods kube-scheduler may be allocating for, and
        hand it to the placer (``ClaimPlacer.look``)."""
        kinds: dict[PodAsk, tuple[tuple[ClaimAsk, ...], int, float]] = {}
        for pod, asks, fixed in self.kube_allocating.values():
            ask = self.placer.ask_of(pod, asks, fixed)
            when = self.handed_at.get(uid_of(pod), 0.0)
            known = kinds.get(ask)
            kinds[ask] = (asks, 1, when) if known is None else (known[0], known[1] + 1, max(known[2], when))
        latest = sorted(kinds.items(), key=lambda item: item[1][2], reverse=True)[:MAX_FENCED_KINDS]
        weighed = {ask: count for ask, (_, count, _) in latest}
        asks_of = {ask: asks for ask, (asks, _, _) in latest}
        if not weighed:
            self._rooms.clear()
            self.kept = NO_ROOM_KEPT
        else:
            self._keep(weighed, asks_of)
        self._weighed = weighed
        self.placer.look(self.kept)

    def _keep(self, weighed: dict[PodAsk, int], asks_of: dict[PodAsk, tuple[ClaimAsk, ...]]) -> None:
        """Each node's room, worked out again where its ledger, CPU or memory changed or the kinds weighed did
        (what a kind could take there, only where the node changed); ``kept`` stays the same object while no
        node's room changed."""
        rooms: dict[str, KeptNodeRoom] = {}
        changed = False
        for name, node, ledger, given in self.placer.shown():
            stamp = (
                id(ledger),
                ledger.version,
                node.cpu_version,
                node.memory_allocatable,
                node.model,
                id(given),
                node.facts,
            )
            known = self._rooms.get(name)
            same = known is not None and known.stamp == stamp
            if known is not None and same and weighed == self._weighed:
                rooms[name] = known
                continue
            before = known.takes if known is not None and same else {}
            takes = {
                ask: before[ask]
                if ask in before
                else (could_take(asks_of[ask], ledger, given) if self.placer.admits(node, ask, generous=True) else {})
                for ask in weighed
            }
            room = kept_room(((takes[ask], count) for ask, count in weighed.items()), ledger)
            rooms[name] = KeptNodeRoom(stamp, (ledger, given), takes, room)
            changed = changed or known is None or known.room != room
        changed = changed or rooms.keys() != self._rooms.keys() or self.kept is NO_ROOM_KEPT
        self._rooms = rooms
        if changed:
            self.kept = {name: node_room.room for name, node_room in rooms.items() if node_room.room}

    def holds(self, uid: str, now: float) -> bool:
        """Whether the room kept is counted for the gated pod ``uid``: while any is kept, unless the fence has
        held the pod back ``KUBE_WINDOW_SECONDS`` in a row (then it is placed as if none were)."""
        since = self.held_since.get(uid)
        return bool(self.kept) and (since is None or now - since < KUBE_WINDOW_SECONDS)

    def held_back(self, uid: str, now: float, *, held: bool) -> None:
        """Whether the fence held the gated pod back this time: a pod that went a step unheld starts again."""
        if held:
            self.held_since.setdefault(uid, now)
        else:
            self.held_since.pop(uid, None)

    def _uses_ours(self, pod: PodBody, claims: Mapping[str, Any]) -> bool:
        """Whether a claim of the pod asks for this driver's class, allocated or not."""
        for _, name in claim_names(pod):
            claim = claims.get(name) if name is not None else None
            if claim is not None and asks_class(claim, self.device_class):
                return True
        return False


def clear_if_over(seen: set[str], limit: int = 100_000) -> None:
    """Keep a set of UIDs bounded: past ``limit`` UIDs, it is emptied whole (a UID seen again is counted again)."""
    if len(seen) > limit:
        seen.clear()
