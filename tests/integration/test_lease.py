"""Leader election on the fake API server: a replica that cannot answer lets the Lease go (issue #39)."""

from __future__ import annotations

import threading

from gpushared.kube.lease import LeaderElector
from tests.fakes.apiserver import FakeApiServer
from tests.harness import wait_until


def elector(api: FakeApiServer, identity: str, alive: threading.Event) -> LeaderElector:
    return LeaderElector(
        api.rest(),
        namespace="kube-system",
        name="gpushared-extender",
        identity=identity,
        lease_seconds=1.5,
        renew_deadline=1.0,
        retry_seconds=0.2,
        alive=alive.is_set,
    )


def holder(api: FakeApiServer) -> str:
    lease = api.get("leases", "gpushared-extender", "kube-system") or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def test_a_leader_whose_loop_stops_answering_stops_renewing_and_the_follower_takes_over() -> None:
    """Defect: a leader whose event loop was deadlocked kept renewing its Lease every 2 s from the election
    thread, and the follower forwarded every verb to it. Renewal now waits on the loop's heartbeat."""
    a_alive, b_alive = threading.Event(), threading.Event()
    a_alive.set()
    b_alive.set()
    with FakeApiServer() as api:
        a = elector(api, "a", a_alive)
        a.start()
        wait_until(lambda: a.leading, message="a leads")
        b = elector(api, "b", b_alive)
        b.start()
        try:
            wait_until(lambda: b.holder == "a", message="b sees a")
            assert not b.leading
            assert b.held  # the steering webhook gates on b: a leader is there to steer
            a_alive.clear()  # a's loop wedges
            wait_until(lambda: not a.leading, timeout=3, message="a stops leading within its renew deadline")
            wait_until(lambda: not b.held or b.leading, timeout=3, message="b sees the Lease go unrenewed")
            wait_until(lambda: b.leading and holder(api) == "b", timeout=5, message="b takes the Lease")
            assert not a.leading
            a_alive.set()  # a answers again: it follows, it does not take the Lease back
            wait_until(lambda: a.holder == "b", message="a sees b")
            assert holder(api) == "b" and not a.leading
        finally:
            a.stop()
            b.stop()


def test_a_wedged_event_loop_ends_the_process() -> None:
    """Wherever the extender runs, a loop that has run no timer for the bound exits the process (status
    70) for its supervisor to start again; a loop that beats keeps it."""
    from gpushared.extender.tasks import Heartbeat, watchdog

    now = [0.0]
    heartbeat = Heartbeat(clock=lambda: now[0])
    exits: list[int] = []

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if now[0] < 30:
            heartbeat.beat()  # the loop runs for 30 s, then wedges

    watchdog(heartbeat, within=60.0, exit=exits.append, sleep=sleep)
    assert exits == [70]
    assert 89.0 <= now[0] <= 91.0  # the last beat at 29 s, then 60 s of silence
