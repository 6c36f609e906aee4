"""The claim allocator's fence (issue #54): the pods kube-scheduler may be allocating claims of this driver
for, the nodes the allocator leaves to it meanwhile, and the pods it counts as having reached kube-scheduler
without the gate.

kube-scheduler allocates first fit the claims of the pods it is given ungated (the webhook skipped or down,
a hand-over, a timeout), and two allocators writing different claims could each take the same GPU's last
room. So for ``KUBE_WINDOW_SECONDS`` after such a pod reached kube-scheduler, the allocator writes nothing
on the nodes where its pending claims fit as kube-scheduler may see them (``ClaimPlacer.fitting``: the
claims the watch shows, without the allocator's writes it may not show yet). A pod that fits nowhere holds
nothing; with more than ``MOST_FENCED_PODS`` of them every node is held.

Owned by the allocator, on the extender's event loop, like everything it keeps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpushared.core.placement.claims import ClaimAsk, asks_class, claim_names, read_pod
from gpushared.core.shared.bodies import Key, PodBody, key_of, uid_of

#: A namespace's claims by name (``ClaimBook.claims``).
Claims = Callable[[str], Mapping[str, Any]]
#: The nodes where a pod's pending claims fit as kube-scheduler may see them (``ClaimPlacer.fitting``).
Fitting = Callable[[PodBody, Sequence[ClaimAsk], str | None], set[str]]

#: How long after a pod with pending claims of this driver reached kube-scheduler (handed over, or never
#: gated) the allocator writes nothing on the nodes where that pod's claims fit: kube-scheduler tries a pod
#: within moments of its gate going. Past it (a pod kube-scheduler keeps trying), the driver's check at
#: prepare is what stops a GPU going past its capacity, so one such pod never stops the allocator for good.
KUBE_WINDOW_SECONDS = 10.0
#: Pods kube-scheduler may be allocating for that the fence looks at one by one; past them it holds every node.
MOST_FENCED_PODS = 32
#: Why a pod waits while the fence holds the nodes it fits.
FENCED = (
    "kube-scheduler may be allocating claims of pods it was given on the nodes with room for it; "
    "the allocator waits so that the two never take one GPU between them"
)


class ClaimFence:
    def __init__(
        self,
        claims: Claims,
        fitting: Fitting,
        *,
        device_class: str,
        counts: Counter[str],
        told: Callable[[PodBody], None],
    ) -> None:
        """``counts``: the allocator's, where pods not gated are counted; ``told``: tells such a pod why."""
        self.claims, self.fitting, self.device_class = claims, fitting, device_class
        self.counts, self.told = counts, told
        #: pods kube-scheduler may be allocating claims of this driver for (ungated, claims pending), with their
        #: pending asks and the node an allocated claim fixes
        self.kube_allocating: dict[Key, tuple[PodBody, tuple[ClaimAsk, ...], str | None]] = {}
        #: the nodes held this step (``hold``; None: every node)
        self.held: frozenset[str] | None = frozenset()
        #: pod UID -> when it reached kube-scheduler with pending claims of this driver
        self.handed_at: dict[str, float] = {}
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
        del_oldest(self.passed)

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
            del_oldest(self.not_gated)
            self.counts["not_gated"] += 1
            self.told(pod)
        read = read_pod(pod, claims, device_class=self.device_class)
        if read.asks and now - self.handed_at.setdefault(uid, now) < KUBE_WINDOW_SECONDS:
            self.kube_allocating[key] = (pod, read.asks, read.node)

    def hold(self) -> None:
        """Work out the nodes held this step: those where the pending claims of kube-scheduler's pods fit."""
        if len(self.kube_allocating) > MOST_FENCED_PODS:
            self.held = None
            return
        held: set[str] = set()
        for pod, asks, fixed in self.kube_allocating.values():
            held |= self.fitting(pod, asks, fixed)
        self.held = frozenset(held)

    def _uses_ours(self, pod: PodBody, claims: Mapping[str, Any]) -> bool:
        """Whether a claim of the pod asks for this driver's class, allocated or not."""
        for _, name in claim_names(pod):
            claim = claims.get(name) if name is not None else None
            if claim is not None and asks_class(claim, self.device_class):
                return True
        return False


def del_oldest(seen: set[str], most: int = 100_000) -> None:
    """Keep a set of UIDs bounded: past ``most``, it is emptied (a UID seen again is counted again)."""
    if len(seen) > most:
        seen.clear()
