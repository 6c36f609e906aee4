"""What a bind counts before the pod watch shows it, and the only things that end that count: evidence.

A bind counts its pod on the chosen node before it writes the Binding, so that two binds to one node see
each other. That count must outlive the write until the cluster says where the pod is, because:

- **a watch can stall.** An API server or a proxy that keeps the stream open and silent delivers nothing,
  while Bindings still succeed. Releasing an unconfirmed bind after a time would give its memory away
  again and again (docs/benchmarks.md, "Figures behind the code"). So a bind the watch has not confirmed
  after ``CONFIRM_SECONDS`` is *read back* from the API server, and what the read shows is counted; a read
  that fails leaves it counted and is tried again.
- **a Binding's answer can be lost.** A timeout, a cut connection or a 5xx says nothing about whether the
  Binding landed: kube-apiserver may apply it after the client gave up. Such a bind stays counted on its
  node as an *unanswered Binding*, under a key of its own (``ghost_uid``), so kube-scheduler may try the pod
  elsewhere at once while the first node keeps the memory the late Binding would take. It ends when the
  pod is seen bound (anywhere: a bound pod refuses every other Binding), deleted, re-created, or still
  unbound ``LANDING_SECONDS`` after the write (kube-apiserver's own request timeout is 60 s).

:func:`settle` is the decision, a pure function of the reservation, what the API server answered and the
time; the cache applies it, and the extender's settler task makes the reads.

- **an earlier extender's Binding can land after it is gone.** A process killed (or a leader stopped)
  with a Binding held at the API server leaves no reservation anyone can read: its successor, counting
  from the watch, would give that memory to another pod, and then the first Binding lands (measured
  20/16 GiB). So after a start, and after taking the Lease, an extender *fences* its binds
  (:func:`fenced`): until ``LANDING_SECONDS`` have passed, it binds nothing while any pod that was
  waiting for a node when it started (one whose Binding an earlier extender may have in flight) is still
  unbound and not deleted. Pods that wait for nothing cost nothing: with none pending at the start, or
  once each is bound or gone, binds go on at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpushared.core.shared.bodies import PodBody, meta_of, node_of, uid_of

#: A bind the watch has not shown bound after this long is read back from the API server.
CONFIRM_SECONDS = 5.0
#: A read-back that did not settle a reservation is repeated this often.
CHECK_SECONDS = 5.0
#: How long after it was sent a Binding whose answer was lost may still land.
LANDING_SECONDS = 120.0
#: The deadline every Binding of gpushared's carries (``?timeout=``): from Kubernetes 1.21 the API server
#: plumbs it to its storage write, so a Binding it has not applied by then it never applies.
#: A Binding is one small write: milliseconds, or a second or two on an API server under load; one that
#: takes longer answers 504 and kube-scheduler tries the pod again.
BINDING_TIMEOUT_SECONDS = 3.0
#: After a start or a takeover, binds wait this long while pods an earlier extender could have been binding
#: stay unbound: what the API server can still apply of a Binding sent before (its deadline), and half a
#: second for the request's way there. Not ``LANDING_SECONDS``: that window made every restart a two-minute
#: stop.
FENCE_SECONDS = BINDING_TIMEOUT_SECONDS + 0.5


@dataclass
class Assumed:
    """A pod this extender counted on ``node`` before the watch showed it there."""

    uid: str
    namespace: str
    name: str
    node: str
    #: when the Binding was sent (the cache's clock)
    since: float
    #: True: the Binding's answer never came (timeout, cut, 5xx); False: the API server said it was created
    unanswered: bool = False
    #: not read back before this time
    check_at: float = 0.0

    @property
    def key(self) -> str:
        """The key the pod is counted under: its UID, or for an unanswered Binding a key of its own."""
        return ghost_uid(self.uid, self.node) if self.unanswered else self.uid

    def describe(self) -> str:
        what = "unanswered Binding" if self.unanswered else "Binding"
        return f"{what} of pod {self.namespace}/{self.name} to node {self.node}"


def ghost_uid(uid: str, node: str) -> str:
    """The ledger key of an unanswered Binding of pod ``uid`` to ``node``: never a real UID (it has a '@')."""
    return f"{uid}@{node}"


class Action(enum.Enum):
    #: nothing known yet: keep counting the pod where the bind put it, read again later
    WAIT = "wait"
    #: the API server shows the pod bound: count it from the body read, where it is
    COUNT = "count"
    #: the pod will never be on that node by this Binding: stop counting the reservation
    RELEASE = "release"


@dataclass(frozen=True)
class Settlement:
    action: Action
    reason: str


def settle(assumed: Assumed, read: PodBody | None, *, now: float, landing: float = LANDING_SECONDS) -> Settlement:
    """What the API server's answer about the pod means for the reservation.

    ``read`` is the pod as read back, or None when the API server answered 404 (a read that failed is no
    evidence, and is not settled at all); ``landing`` is how long after it was sent a Binding may land."""
    what = assumed.describe()
    if read is None:
        return Settlement(Action.RELEASE, f"{what}: the pod is deleted")
    if uid_of(read) != assumed.uid:
        return Settlement(Action.RELEASE, f"{what}: the pod was deleted and created again")
    node = node_of(read)
    if node:
        where = "there" if node == assumed.node else f"to node {node}"
        return Settlement(Action.COUNT, f"{what}: the API server shows the pod bound {where}")
    if meta_of(read).get("deletionTimestamp"):
        return Settlement(Action.RELEASE, f"{what}: the pod is being deleted without a node")
    if now - assumed.since < landing:
        return Settlement(Action.WAIT, f"{what}: the pod is not bound yet; the Binding may still land")
    return Settlement(Action.RELEASE, f"{what}: the pod is still unbound {landing:.0f} s after the Binding")


#: The first Kubernetes whose API server holds a request's storage write to the request's ``?timeout=``.
DEADLINE_TO_STORAGE = (1, 21)


def fence_window(version: tuple[int, int] | None, *, landing: float) -> float:
    """How long after a start or a takeover an earlier extender's Binding may still be applied: its deadline
    and half a second from 1.21; before, or where the version is not known, ``landing`` (a 1.20 API server answers
    504 at the deadline but a write already under way still completes)."""
    if version is not None and version >= DEADLINE_TO_STORAGE:
        return FENCE_SECONDS
    return landing


def fenced(*, now: float, until: float, in_doubt: int) -> str | None:
    """Why a bind must wait, or None: before ``until`` (the start or the takeover plus ``FENCE_SECONDS``)
    while ``in_doubt`` other pods that were pending then are still unbound, an earlier extender's Binding
    may yet land on the memory this bind would take. The pod being bound is never its own doubt: its old
    Binding and the new one cannot both land (a bound pod refuses every other Binding), so the caller
    leaves it out of ``in_doubt``."""
    if in_doubt <= 0 or now >= until:
        return None
    return (
        f"binds wait {until - now:.0f} s more for Bindings an earlier extender may still have in flight "
        f"({in_doubt} pods pending when this extender started or took over are still unbound)"
    )
