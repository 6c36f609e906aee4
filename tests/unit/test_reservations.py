"""When a bind's reservation may end: only on evidence from the API server (``reservations.settle``), never
because time passed while the watch said nothing."""

from __future__ import annotations

from typing import Any

import pytest

from gpushared import contract
from gpushared.core.placement import reservations
from gpushared.core.placement.policies import BINPACK
from gpushared.core.placement.reservations import (
    CONFIRM_SECONDS,
    LANDING_SECONDS,
    Action,
    Assumed,
    fenced,
    ghost_uid,
    settle,
)
from gpushared.core.shared.requests import pod_request
from gpushared.extender.cache import ClusterCache, Rejected
from tests.builders import inventory, pod
from tests.extender_harness import gpu_node


def read(uid: str = "u1", node: str | None = None, *, deleting: bool = False) -> dict[str, Any]:
    body = pod("p", 4, uid=uid, node=node)
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-11-23T00:00:00Z"
    return body


SENT = Assumed("u1", "default", "p", "n1", since=0.0)
LOST = Assumed("u1", "default", "p", "n1", since=0.0, unanswered=True)


@pytest.mark.parametrize(
    ("assumed", "answer", "now", "action"),
    [
        (SENT, None, 10.0, Action.RELEASE),  # 404: deleted
        (SENT, read("u2", "n1"), 10.0, Action.RELEASE),  # another pod under the name
        (SENT, read(node="n1"), 10.0, Action.COUNT),  # bound where the bind put it: the watch lags
        (SENT, read(node="n2"), 10.0, Action.COUNT),  # bound elsewhere: counted there
        (SENT, read(), 10.0, Action.WAIT),  # not bound yet: may still land
        (SENT, read(), LANDING_SECONDS + 1, Action.RELEASE),
        (SENT, read(deleting=True), 10.0, Action.RELEASE),  # deleting, unbound: no Binding can land
        (LOST, read(), 10.0, Action.WAIT),
        (LOST, read(), LANDING_SECONDS - 1, Action.WAIT),
        (LOST, read(), LANDING_SECONDS + 1, Action.RELEASE),
        (LOST, read(node="n1"), 10.0, Action.COUNT),  # it landed
        (LOST, read(node="n2"), 10.0, Action.COUNT),  # bound elsewhere: the lost one can never land
        (LOST, None, 10.0, Action.RELEASE),
    ],
)
def test_settle(assumed: Assumed, answer: dict[str, Any] | None, now: float, action: Action) -> None:
    outcome = settle(assumed, answer, now=now)
    assert outcome.action is action, outcome.reason
    assert "pod default/p" in outcome.reason


def test_the_key_of_an_unanswered_binding_is_never_a_uid() -> None:
    assert LOST.key == ghost_uid("u1", "n1") != "u1" and SENT.key == "u1"


def cache_at(now: list[float]) -> ClusterCache:
    cache = ClusterCache(
        list_nodes=lambda **_: None,
        list_pods=lambda **_: None,
        resources=contract.DEFAULT_RESOURCES,
        clock=lambda: now[0],
    )
    cache.on_node(None, gpu_node("n1", inv=inventory(16)))
    return cache


def fits(cache: ClusterCache, amount: int) -> bool:
    return cache.index.filter(["n1"], pod_request(pod("probe", amount)))[0] == ["n1"]


def test_a_bind_the_watch_never_shows_keeps_its_memory_however_long() -> None:
    """Defect: a stalled watch used to release every bind after 60 s, and the memory was bound again."""
    now = [0.0]
    cache = cache_at(now)
    pending = pod("p", 10, uid="u1")
    cache.on_pod(None, pending)
    reserved = cache.reserve("n1", pending, pod_request(pending), policy=BINPACK, now_ns=1)  # type: ignore[arg-type]
    assert not isinstance(reserved, Rejected)
    for _ in range(100):  # ten minutes of silence, read on every filter
        now[0] += 6
        assert not fits(cache, 10)
    # The settler reads it back: bound there. It stays counted, now from the API server's body.
    (due,) = cache.due(limit=10)
    bound = read(node="n1")
    bound["metadata"]["annotations"] = reserved.annotations
    outcome = cache.settle(due, bound)
    assert outcome is not None and outcome.action is Action.COUNT
    assert not fits(cache, 10) and fits(cache, 6) and cache.reservations.unconfirmed() == 0


def test_a_read_back_that_fails_settles_nothing_and_is_tried_again() -> None:
    now = [0.0]
    cache = cache_at(now)
    pending = pod("p", 10, uid="u1")
    assert not isinstance(cache.reserve("n1", pending, pod_request(pending), policy=BINPACK, now_ns=1), Rejected)  # type: ignore[arg-type]
    assert cache.due(limit=10) == []  # the watch gets CONFIRM_SECONDS first
    now[0] += CONFIRM_SECONDS
    assert len(cache.due(limit=10)) == 1
    assert cache.due(limit=10) == []  # handed out once per CHECK_SECONDS
    now[0] += CONFIRM_SECONDS
    assert len(cache.due(limit=10)) == 1 and not fits(cache, 10)


def test_an_unanswered_binding_keeps_its_memory_while_the_pod_is_tried_elsewhere() -> None:
    """Defect: a Binding that timed out on the client but landed on the server was forgotten; the memory went
    to another pod, then the Binding landed: 20/16."""
    now = [0.0]
    cache = cache_at(now)
    cache.on_node(None, gpu_node("n2", inv=inventory(16)))
    pending = pod("p", 10, uid="u1")
    cache.on_pod(None, pending)
    assert not isinstance(cache.reserve("n1", pending, pod_request(pending), policy=BINPACK, now_ns=1), Rejected)  # type: ignore[arg-type]
    cache.unanswered(pending, "n1")
    assert not fits(cache, 10)  # the late Binding may take it
    # kube-scheduler tries the pod again, on n2: allowed, and both nodes hold it until the truth is known
    assert not isinstance(cache.reserve("n2", pending, pod_request(pending), policy=BINPACK, now_ns=2), Rejected)  # type: ignore[arg-type]
    assert not cache.index.filter(["n1", "n2"], pod_request(pod("probe", 10)))[0]
    # The watch shows it bound to n2: no Binding to n1 can land any more.
    bound = read(node="n2")
    cache.on_pod(pending, bound)
    assert fits(cache, 10) and cache.reservations.unconfirmed() == 0


def test_a_second_bind_of_a_pod_whose_binding_was_created_is_refused() -> None:
    """Counting it on another node would free what it holds on the first before the watch shows it there."""
    cache = cache_at([0.0])
    pending = pod("p", 10, uid="u1")
    assert not isinstance(cache.reserve("n1", pending, pod_request(pending), policy=BINPACK, now_ns=1), Rejected)  # type: ignore[arg-type]
    again = cache.reserve("n1", pending, pod_request(pending), policy=BINPACK, now_ns=2)  # type: ignore[arg-type]
    assert again == Rejected("it is already bound to node n1 (the watch has not shown it yet)")
    assert not fits(cache, 10) and fits(cache, 6)


@pytest.mark.parametrize(
    ("now", "until", "in_doubt", "waits"),
    [
        (0.0, 120.0, 3, True),  # just started, three pods pending then still unbound
        (119.0, 120.0, 1, True),
        (120.0, 120.0, 1, False),  # the landing window has passed: nothing can land any more
        (5.0, 120.0, 0, False),  # nothing was pending, or each is bound or gone: binds go on at once
    ],
)
def test_binds_are_fenced_only_while_an_earlier_binding_can_land(
    now: float, until: float, in_doubt: int, waits: bool
) -> None:
    reason = fenced(now=now, until=until, in_doubt=in_doubt)
    assert (reason is not None) is waits
    if reason:
        assert f"{in_doubt} pods" in reason and f"{until - now:.0f} s" in reason


def test_the_fence_holds_pods_that_fit_until_each_is_seen_bound_or_gone() -> None:
    """A killed extender's successor (issue #39, defect 3): the pods pending at its start that it could place
    are in doubt; one the watch then shows bound or deleted is not; one that fits nowhere never was."""
    now = [0.0]
    cache = ClusterCache(
        list_nodes=lambda **_: None,
        list_pods=lambda **_: None,
        resources=contract.DEFAULT_RESOURCES,
        clock=lambda: now[0],
        landing_seconds=30.0,
    )
    cache.on_node(None, gpu_node("n1", inv=inventory(16), cpu="8"))
    small, other, huge = pod("small", 4, uid="s"), pod("other", 2, uid="o"), pod("huge", 40, uid="h")
    for body in (small, other, huge):
        cache.pods._set(body)  # the watch's mirror, as listed: its handler puts each in the inbox
    assert cache.arm_fence() == 0  # the owner has not applied them yet
    assert cache.inbox.drain() == 3
    assert cache.arm_fence() == 2
    assert cache.reservations.fenced() is not None and "2 pods" in cache.reservations.fenced()  # type: ignore[operator]
    bound = {**small, "spec": {**small["spec"], "nodeName": "n1"}}
    cache.pods._apply({"type": "MODIFIED", "object": bound}, "2")  # the earlier extender's Binding landed
    cache.inbox.drain()
    assert "1 pods" in (cache.reservations.fenced() or "")
    cache.pods._apply({"type": "DELETED", "object": other}, "3")
    cache.inbox.drain()
    assert cache.reservations.fenced() is None
    assert cache.arm_fence() == 0  # armed again (a takeover): "huge" fits nowhere, "small" is bound
    cache.pods._set({**pod("late", 1, uid="l")})
    cache.inbox.drain()
    assert cache.arm_fence() == 1
    now[0] = cache.reservations.fence_seconds
    assert cache.reservations.fenced() is None  # the window has passed


def test_a_pods_own_doubt_never_holds_its_own_bind() -> None:
    """Issue #52, item 10: its old Binding and the new one cannot both land, so a waiting pod's bind waits
    only for the other pods in doubt."""
    cache = ClusterCache(
        list_nodes=lambda **_: None, list_pods=lambda **_: None, resources=contract.DEFAULT_RESOURCES, clock=lambda: 0.0
    )
    cache.on_node(None, gpu_node("n1", inv=inventory(16), cpu="8"))
    for body in (pod("a", 4, uid="a"), pod("b", 4, uid="b")):
        cache.pods._set(body)
    cache.inbox.drain()
    assert cache.arm_fence() == 2
    assert "1 pods" in (cache.reservations.fenced("a") or "")
    cache.pods._apply({"type": "DELETED", "object": pod("b", 4, uid="b")}, "2")
    cache.inbox.drain()
    assert cache.reservations.fenced("a") is None, "only its own doubt is left"
    assert cache.reservations.fenced() is not None, "it still holds every other pod's bind"


def test_pods_of_other_schedulers_are_never_in_doubt() -> None:
    cache = ClusterCache(
        list_nodes=lambda **_: None,
        list_pods=lambda **_: None,
        resources=contract.DEFAULT_RESOURCES,
        clock=lambda: 0.0,
        schedulers=frozenset({"default-scheduler", "gpushared-scheduler"}),
    )
    cache.on_node(None, gpu_node("n1", inv=inventory(16), cpu="8"))
    mine, second, other = pod("mine", 4, uid="m"), pod("second", 4, uid="s"), pod("other", 4, uid="o")
    second["spec"]["schedulerName"] = "gpushared-scheduler"
    other["spec"]["schedulerName"] = "volcano"
    for body in (mine, second, other):
        cache.pods._set(body)
    cache.inbox.drain()
    assert cache.arm_fence() == 2


@pytest.mark.parametrize(
    ("version", "window"),
    [
        ((1, 36), reservations.FENCE_SECONDS),
        ((1, 21), reservations.FENCE_SECONDS),
        ((1, 20), 120.0),  # the deadline does not reach storage there: the landing window
        (None, 120.0),  # not known: the safe one
    ],
)
def test_the_fence_lasts_what_the_api_server_can_still_apply(version: tuple[int, int] | None, window: float) -> None:
    assert reservations.fence_window(version, landing=120.0) == window
    assert reservations.FENCE_SECONDS < 5.0
