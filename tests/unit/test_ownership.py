"""The extender's cluster state has one owner (issue #40): the thread that claimed it, the event loop's in
the extender. Informer threads only put their changes in the cache's inbox; every other thread that
touches the state is refused at once; and no module of the extender takes a lock."""

from __future__ import annotations

import ast
import asyncio
import threading
from pathlib import Path
from typing import Any

from gpushared import contract
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.placement.policies import BINPACK
from gpushared.core.placement.reservations import Action
from gpushared.core.shared.requests import pod_request
from gpushared.extender.cache import ClusterCache, Rejected, Reservation
from gpushared.extender.http.wire import ExtenderArgs
from gpushared.extender.inbox import OwnershipError
from gpushared.extender.scheduler import Scheduler
from tests.builders import inventory, pod
from tests.extender_harness import gpu_node

EXTENDER = Path(__file__).resolve().parents[2] / "gpushared" / "extender"
INV = inventory(16, 16)


def a_cache() -> ClusterCache:
    cache = ClusterCache(list_nodes=lambda **_: None, list_pods=lambda **_: None, resources=contract.DEFAULT_RESOURCES)
    cache.on_node(None, gpu_node("n1", inv=INV, cpu="8"))
    return cache


def on_another_thread(call: Any) -> BaseException | None:
    caught: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=run, name="intruder")
    thread.start()
    thread.join()
    return caught[0] if caught else None


def test_the_state_belongs_to_the_thread_that_claimed_it() -> None:
    cache = a_cache()
    scheduler = Scheduler(
        cache=cache,
        api=None,
        policy=BINPACK,
        resources=contract.DEFAULT_RESOURCES,
        rank_in_filter=True,  # type: ignore[arg-type]
    )
    cache.owner.claim()
    args = ExtenderArgs(pod=pod("p", 4), node_names=["n1"], nodes=None)
    intrusions = {
        "a pod event": lambda: cache.on_pod(None, pod("p", 4)),
        "a node event": lambda: cache.on_node(None, gpu_node("n2", inv=INV)),
        "reserve": lambda: cache.reserve("n1", pod("p", 4), pod_request(pod("p", 4)), policy=BINPACK, now_ns=1),
        "forget": lambda: cache.forget(pod("p", 4), "n1"),
        "settle": lambda: cache.settle(None, None),  # type: ignore[arg-type]
        "applying the informers' changes": cache.inbox.drain,
        "filter": lambda: scheduler.filter(args),
        "prioritize": lambda: scheduler.prioritize(args),
    }
    for what, call in intrusions.items():
        refused = on_another_thread(call)
        assert isinstance(refused, OwnershipError), what
        assert what in str(refused) and "'intruder'" in str(refused)
    assert cache.state.node_names() == ["n1"] and not cache.pending  # nothing of theirs got in
    assert scheduler.filter(args).passed == ["n1"]  # the owner is served


def test_the_informers_thread_only_puts_changes_in_the_inbox() -> None:
    """A pod watch on its own thread delivers thousands of binds and deletions while the event loop
    reserves and settles against the same pods: the loop applies every change itself (nothing is applied
    on the informer's thread), no call is refused, and at the end the books are exactly the watch's.
    Under the old locks this interleaving deadlocked (issue #39); with one owner there is no lock to wait
    for, and the loop finishes."""
    cache = a_cache()
    bodies = [pod(f"p{i}", 1, uid=f"u{i}") for i in range(20)]
    rounds = 100
    applied_on: set[str] = set()
    apply = cache._apply

    def watched(kind: str, old: Any, new: Any) -> None:
        applied_on.add(threading.current_thread().name)
        apply(kind, old, new)

    cache.inbox._apply = watched
    errors: list[BaseException] = []

    def watch() -> None:
        informer: Any = cache.pods
        version = 1
        gpu = INV.gpus[0]
        for _ in range(rounds):
            for body in bodies:
                version += 1
                bound = {**body, "metadata": {**body["metadata"], "resourceVersion": str(version)}}
                bound["spec"] = {**body["spec"], "nodeName": "n1"}
                bound["metadata"]["annotations"] = bind_annotations(pod_request(body), [gpu], unit=INV.unit, now_ns=1)
                try:
                    informer._apply({"type": "MODIFIED", "object": bound}, str(version))
                    informer._apply({"type": "DELETED", "object": bound}, str(version))
                except BaseException as exc:
                    errors.append(exc)
                    return

    async def owner() -> int:
        loop = asyncio.get_running_loop()
        cache.owner.claim()
        cache.inbox.attach(loop)
        watching = threading.Thread(target=watch, name="informer-pods")
        watching.start()
        turns = 0
        while watching.is_alive() or len(cache.inbox):
            for body in bodies[:5]:
                reserved = cache.reserve("n1", body, pod_request(body), policy=BINPACK, now_ns=1)
                if isinstance(reserved, Reservation):
                    for assumed in [*cache.due(limit=64), cache.reservations.assumed(body["metadata"]["uid"])]:
                        if assumed is not None:
                            outcome = cache.settle(assumed, None)  # read back: the pod is gone
                            assert outcome is None or outcome.action is Action.RELEASE
                else:
                    assert isinstance(reserved, Rejected)
            turns += 1
            await asyncio.sleep(0)
        watching.join()
        return turns

    turns = asyncio.run(owner())
    assert errors == [] and turns > 0
    assert applied_on == {"MainThread"}
    assert cache.inbox.applied == 2 * rounds * len(bodies)
    ledger = cache.state.nodes["n1"].ledger
    assert ledger is not None and list(ledger.holdings()) == []  # every pod deleted, every reservation released
    assert cache.reservations.unconfirmed() == 0 and not cache.state.node_of


def locks_in(root: Path) -> list[str]:
    """Every lock, condition or semaphore of ``threading``, and every ranked lock, the modules under ``root``
    import or name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [f"{node.value.id}.{node.attr}"]
            for name in names:
                if name.startswith("gpushared.kube.locks") or name in THREADING_LOCKS:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


THREADING_LOCKS = {f"threading.{kind}" for kind in ("Lock", "RLock", "Condition", "Semaphore", "BoundedSemaphore")}


def test_no_module_of_the_extender_takes_a_lock() -> None:
    """The ownership check in CI: no lock, condition or semaphore of ``threading`` and no ranked lock anywhere
    in the extender (the HTTP transport's asyncio primitives pace callers; they guard no cluster state)."""
    assert locks_in(EXTENDER) == []


def test_the_lock_check_finds_a_lock(tmp_path: Path) -> None:
    """The check above is not vacuous."""
    (tmp_path / "state.py").write_text("import threading\nlock = threading.RLock()\n")
    (tmp_path / "index.py").write_text("from gpushared.kube.locks import RankedLock\n")
    assert locks_in(tmp_path) == ["index.py:1: gpushared.kube.locks.RankedLock", "state.py:2: threading.RLock"]
