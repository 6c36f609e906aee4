"""A restart or a takeover with 100 GPU pods waiting (issue #52, item 10): the fence that keeps a dead
extender's in-flight Binding from landing on memory its successor gave away fences only what can still land,
so GPU binding does not stop for the old two-minute window. Counted from the API server's objects."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.builders import pod
from tests.extender_harness import Extender, gpu_node, lease_holder
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.harness import wait_until
from tests.integration.test_extender_ha import over_capacity

NODES = 20
WAITING = 100


@pytest.fixture
def cluster() -> Iterator[FakeApiServer]:
    with FakeApiServer(history=50_000) as api:
        for i in range(NODES):
            api.create(gpu_node(f"node-{i:02d}", 16, 16))  # 640 GiB in all
        yield api


def bind_every_waiting_pod(replicas: list[Extender], bodies: list[dict[str, Any]], *, within: float) -> list[float]:
    """kube-scheduler's part, from 8 threads: filter, bind to the first passing node, retry on refusal;
    the times of the successful binds."""
    names = [f"node-{i:02d}" for i in range(NODES)]
    queue = list(bodies)
    lock = threading.Lock()
    bound: list[float] = []
    stop_at = time.monotonic() + within

    def leader_call(method: str, *args: Any) -> tuple[int, Any]:
        for replica in replicas:
            status, result = getattr(replica, method)(*args)
            if status != 503:
                return status, result
        return 503, None

    def worker() -> None:
        while time.monotonic() < stop_at:
            with lock:
                if not queue:
                    return
                body = queue.pop(0)
            status, filtered = leader_call("filter", body, *names)
            passing = (filtered or {}).get("NodeNames") or [] if status == 200 else []
            if passing:
                status, result = leader_call("bind", body, passing[0])
                if status == 200 and result == {"Error": ""}:
                    with lock:
                        bound.append(time.monotonic())
                    continue
            time.sleep(0.1)  # kube-scheduler's backoff, shortened
            with lock:
                queue.append(body)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return bound


#: What the fence held every bind for before issue #52 (the landing window, 120 s by default). The promise
#: itself (first bind within 5 s, all within 30 s) is measured, not asserted, by the fault suite's
#: "restart/takeover with 100 pods waiting" scenarios (docs/reliability.md): a pass/fail line that close to
#: the figures would fail on a busy CI machine for no fault of the code. Here the bounds are loose enough
#: for any machine and still far inside the old window, so a fence that holds binds again fails.
FIRST_BIND_SECONDS, ALL_BOUND_SECONDS = 30.0, 60.0


def promise_kept(cluster: FakeApiServer, bound: list[float], *, since: float, what: str) -> None:
    """Binding did not stop for the old window: every waiting pod (all fit) bound, the first long before
    the window would have ended, and no GPU over capacity."""
    assert bound, "nothing bound"
    first, last = min(bound) - since, max(bound) - since
    assert first < FIRST_BIND_SECONDS, f"{what}: first bind {first:.1f} s after"
    assert len(bound) == WAITING and last < ALL_BOUND_SECONDS, (what, len(bound), last)
    assert over_capacity(cluster) == []
    print(f"{what}: first bind {first:.2f} s after, all {WAITING} by {last:.2f} s")


def test_a_restart_with_100_pods_waiting_binds_them_without_waiting_out_the_old_window(
    cluster: FakeApiServer, spawn: Callable[..., Extender]
) -> None:
    bodies = [cluster.create(pod(f"w-{i:03d}", 4)) for i in range(WAITING)]  # 400 of 640 GiB: all fit
    first = spawn(cluster)
    first.wait_ready(60)
    first.process.kill()  # type: ignore[union-attr]  # kill -9 with the pods waiting: a restart
    first.process.wait()  # type: ignore[union-attr]
    again = spawn(cluster)
    again.wait_ready(60)
    ready = time.monotonic()
    bound = bind_every_waiting_pod([again], bodies, within=ALL_BOUND_SECONDS + 10)
    promise_kept(cluster, bound, since=ready, what="restart")


def test_a_takeover_with_100_pods_waiting_binds_them_without_waiting_out_the_old_window(
    cluster: FakeApiServer, spawn: Callable[..., Extender]
) -> None:
    args = ["--leader-elect", "--lease-namespace", "default", "--lease-seconds", "3"]
    bodies = [cluster.create(pod(f"w-{i:03d}", 4)) for i in range(WAITING)]
    first, second = spawn(cluster, name="first", args=args), spawn(cluster, name="second", args=args)
    first.wait_ready(60)
    second.wait_ready(60)

    def holder() -> str:
        return lease_holder(cluster)

    wait_until(holder, timeout=30, message="a leader")
    leader, follower = (first, second) if holder().endswith(f":{first.port}") else (second, first)
    leader.process.kill()  # type: ignore[union-attr]
    leader.process.wait()  # type: ignore[union-attr]
    wait_until(lambda: holder().endswith(f":{follower.port}"), timeout=30, message="the takeover")
    took_over = time.monotonic()
    bound = bind_every_waiting_pod([follower], bodies, within=ALL_BOUND_SECONDS + 10)
    promise_kept(cluster, bound, since=took_over, what="takeover")


def test_a_binding_held_past_its_deadline_never_lands_and_the_successor_waits_for_it(
    cluster: FakeApiServer, spawn: Callable[..., Extender]
) -> None:
    """The fence still holds what can land: a Binding held at the API server while its extender dies is
    applied within its deadline or never (1.21+), and the successor binds nothing in that time."""
    first = spawn(cluster)
    first.wait_ready(60)
    held = cluster.create(pod("held", 16))
    again_body = cluster.create(pod("again", 16))
    fault = Fault(method="POST", path=r"/pods/held/binding$", delay=5.0, times=1)  # past its 3 s deadline
    cluster.inject(fault)
    threading.Thread(target=lambda: first.bind(held, "node-00"), daemon=True).start()
    wait_until(lambda: fault.hits > 0, timeout=10, message="the Binding held")
    first.process.kill()  # type: ignore[union-attr]
    first.process.wait()  # type: ignore[union-attr]
    again = spawn(cluster)
    again.wait_ready(60)
    status, result = again.bind(again_body, "node-00")
    assert status == 200 and "may still have in flight" in result["Error"], result
    wait_until(lambda: again.bind(again_body, "node-00")[1] == {"Error": ""}, timeout=15, message="bound after")
    assert (cluster.get("pods", "held", "default") or {})["spec"].get("nodeName") is None, "never applied"
    assert over_capacity(cluster) == []
