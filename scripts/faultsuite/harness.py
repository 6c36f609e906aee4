"""The suite's world and kube-scheduler's part in it: a fake API server, two replicas, the load, probes."""

from __future__ import annotations

import argparse
import functools
import random
import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpushared import contract
from gpushared.contract import MemoryUnit
from gpushared.core.shared.ledger import Ledger, holding_from_pod
from tests.extender_harness import Extender, gpu_node
from tests.fakes.apiserver import FakeApiServer
from tests.pki import Authority, Pair


class Hung(Exception):
    """A scenario ran past its deadline: a hang is a failure, not a stuck CI."""


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raise :class:`Hung` in the main thread once ``seconds`` have passed."""

    def expire(signum: int, frame: Any) -> None:
        raise Hung

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class World:
    """One scenario's cluster: the fake API server, two extender replicas, the certificates."""

    def __init__(self, args: argparse.Namespace, work: Path, pki: Authority, pairs: dict[str, Pair]) -> None:
        self.args = args
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        self.pki = pki
        self.pairs = pairs
        self.api = FakeApiServer(history=200_000).start()
        rng = random.Random(args.seed)
        self.nodes = [f"node-{i:03d}" for i in range(args.nodes)]
        for name in self.nodes:
            self.api.create(gpu_node(name, *[rng.choice((8, 16, 24)) for _ in range(rng.randint(1, 4))]))
        self.replicas = [self._extender(name) for name in ("a", "b")]
        for replica in self.replicas:
            wait(lambda r=replica: r.get("/readyz")[0] == 200, 60, f"extender {replica.name} ready")
        #: what each pod's Binding wrote, as read right after a successful bind (the truth where it runs)
        self.written: dict[str, dict[str, str]] = {}
        #: pods the load was told were bound, and where
        self.told: dict[str, str] = {}
        #: each node's GPUs as its daemon published them at the start: the truth the counts hold pods to
        self.inventories = {
            n["metadata"]["name"]: contract.parse_inventory(n["metadata"]["annotations"][contract.NODE_INVENTORY])
            for n in self.api.objects("nodes")
        }
        #: binds a caller without the scheduler's certificate asked for: pod name -> node
        self.forged_binds: dict[str, str] = {}
        #: verbs answered 500 or worse
        self.server_errors: list[str] = []
        #: pods a scenario created with GPU annotations itself (bound around the extender, or pending with a
        #: poisoned allocation): a tenant can, and the counts of the extender's half-done binds leave them out
        self.bypassed: set[str] = set()
        #: replicas stopped on purpose (SIGSTOP): not probed until they run again
        self.stopped: set[str] = set()
        self.lock = threading.Lock()

    def _extender(self, name: str) -> Extender:
        server, scheduler = self.pairs["extender"], self.pairs["scheduler"]
        extender = Extender(
            api=self.api,
            workdir=self.work,
            name=name,
            ca=self.pki.cert,
            client=(scheduler.cert, scheduler.key),
            args=[
                "--leader-elect", "--lease-namespace", "default", "--lease-seconds", "3",
                "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--client-ca", str(self.pki.cert),
                "--client-name", "system:kube-scheduler", "--client-name", "gpushared-extender",
                "--watch-seconds", "5", "--binding-landing-seconds", "12", "--log-level", "info",
            ],
        )  # fmt: skip
        return extender.start()

    @functools.cached_property
    def probe_context(self) -> ssl.SSLContext:
        """The scheduler's client certificate, loaded once for the /healthz probes (every 20 ms each)."""
        context = ssl.create_default_context(cafile=str(self.pki.cert))
        pair = self.pairs["scheduler"]
        context.load_cert_chain(str(pair.cert), str(pair.key))
        return context

    def kill(self, replica: Extender) -> None:
        """SIGKILL, and wait until it is gone: a probe in flight across the kill is no answer to count."""
        assert replica.process is not None
        self.stopped.add(replica.name)
        replica.process.send_signal(signal.SIGKILL)
        replica.process.wait(10)
        self.stopped.discard(replica.name)

    def restart(self, replica: Extender) -> None:
        assert replica.process is not None
        replica.process.wait(10)
        replica.process = None
        replica.start()

    def leader(self) -> Extender | None:
        lease = self.api.get("leases", "gpushared-extender", "default")
        holder = ((lease or {}).get("spec") or {}).get("holderIdentity", "")
        return next((r for r in self.replicas if f":{r.port}" in holder), None)

    def close(self) -> None:
        for replica in self.replicas:
            if replica.process is not None and replica.process.poll() is None:
                replica.process.kill()
                replica.process.wait()
        self.api.stop()


def wait(condition: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting: {what}")
        time.sleep(0.1)


def schedule(world: World, bodies: list[dict[str, Any]], *, threads: int, progress: Callable[[int], None]) -> None:
    """What kube-scheduler does: filter on a sample of nodes, bind to a passing one, filter again after an
    error; a replica that answers 503 (not ready, no leader, stale cache) is tried again a moment later."""
    queue = list(reversed(bodies))
    lock = threading.Lock()
    done = [0]

    def call(rng: random.Random, method: str, *args: Any) -> tuple[int, Any]:
        for _ in range(300):
            replica = rng.choice(world.replicas)
            status, result = getattr(replica, method)(*args)
            if status >= 500 and status != 503:
                with world.lock:
                    world.server_errors.append(f"{method} answered {status}: {str(result)[:120]}")
            if status in (0, 503):  # restarting, not the leader yet, or stale: kube-scheduler retries
                time.sleep(0.1)
                continue
            return status, result
        return 0, None

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            with lock:
                if not queue:
                    return
                body = queue.pop()
            name = body["metadata"]["name"]
            for _attempt in range(8):
                status, result = call(rng, "filter", body, *rng.sample(world.nodes, min(20, len(world.nodes))))
                if status != 200 or not result["NodeNames"]:
                    break
                node = rng.choice(result["NodeNames"])
                status, result = call(rng, "bind", body, node)
                if status == 200 and result["Error"] == "":
                    bound = world.api.get("pods", name, "default") or {}
                    with world.lock:
                        world.told[name] = node
                        world.written[name] = dict((bound.get("metadata") or {}).get("annotations") or {})
                    break
                time.sleep(0.05)
            with lock:
                done[0] += 1
                progress(done[0])

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(900)


#: A /healthz that has not answered after this long is a failure: the promise is 100 ms.
PROBE_TIMEOUT = 1.0


def probe_healthz(world: World, replica: Extender) -> tuple[str, float]:
    """One /healthz: ("ok" | "refused" | why it failed, seconds). Refused: nothing listens yet (a replica
    starting again after a kill), which is no answer to count."""
    import http.client

    started = time.perf_counter()
    connection = http.client.HTTPSConnection(
        "127.0.0.1", replica.port, timeout=PROBE_TIMEOUT, context=world.probe_context
    )
    try:
        connection.request("GET", "/healthz")
        status = connection.getresponse().status
        outcome = "ok" if status == 200 else f"answered {status}"
    except ConnectionRefusedError:
        outcome = "refused"
    except TimeoutError:
        outcome = f"no answer within {PROBE_TIMEOUT:.0f} s"
    except OSError as exc:
        outcome = f"failed: {exc}"
    finally:
        connection.close()
    return outcome, time.perf_counter() - started


@contextmanager
def healthz_probe(world: World) -> Iterator[tuple[list[float], list[str]]]:
    """Every 20 ms, each running replica's /healthz: the slowest answer, and every probe that failed."""
    slowest = [0.0]
    failures: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            for replica in world.replicas:
                process = replica.process
                if process is None or process.poll() is not None or replica.name in world.stopped:
                    continue
                outcome, seconds = probe_healthz(world, replica)
                if process.poll() is not None or replica.process is not process or replica.name in world.stopped:
                    continue  # killed, started again or stopped while it was asked
                if outcome == "ok":
                    slowest[0] = max(slowest[0], seconds)
                elif outcome != "refused":
                    failures.append(f"/healthz of {replica.name}: {outcome}")
            time.sleep(0.02)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        yield slowest, failures
    finally:
        stop.set()
        thread.join()


def retry_until_bound(world: World, bodies: list[dict[str, Any]], *, until: float) -> None:
    """kube-scheduler's retries for pods that wait: each tried again (filter, bind) every 0.2 s until it is
    bound or ``until``, as its backoff queue does (``schedule`` gives a pod up after 8 tries)."""
    queue = list(bodies)
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            with lock:
                if not queue:
                    return
                body = queue.pop(0)
            replica = world.leader() or rng.choice(world.replicas)
            status, result = replica.filter(body, *rng.sample(world.nodes, min(20, len(world.nodes))))
            if status == 200 and result["NodeNames"]:
                node = rng.choice(result["NodeNames"])
                status, result = replica.bind(body, node)
                if status == 200 and result["Error"] == "":
                    with world.lock:
                        world.told[body["metadata"]["name"]] = node
                    continue
            time.sleep(0.2)
            with lock:
                queue.append(body)

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(world.args.threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(max(0.0, until - time.monotonic()) + 10)


def free_gpu_memory(world: World) -> int:
    """The largest room on one GPU, from the API server's pods: where a 1 GiB pod could still go."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for body in world.api.objects("pods"):
        if body["spec"].get("nodeName"):
            by_node.setdefault(body["spec"]["nodeName"], []).append(body)
    room = 0
    for name, inventory in world.inventories.items():
        ledger = Ledger.build(inventory)
        for body in by_node.get(name, []):
            holding = holding_from_pod(body, unit=MemoryUnit.GIB)  # type: ignore[arg-type]
            if holding is not None:
                ledger.add(holding)
        room = max([room, *(g.memory - ledger.used(g.index) for g in inventory.gpus if g.healthy)])
    return room


def loop_lag(replica: Extender) -> float:
    """The replica's gpushared_extender_event_loop_lag_max_seconds, in ms (since its last start)."""
    status, text = replica.get("/metrics")
    for line in text.decode().splitlines() if status == 200 else ():
        if line.startswith("gpushared_extender_event_loop_lag_max_seconds "):
            return round(float(line.split()[1]) * 1000, 1)
    return 0.0


def settle(world: World) -> None:
    """Faults mended: both replicas ready and fresh, and every reservation settled by the watch or a read."""
    for replica in world.replicas:
        wait(lambda r=replica: r.get("/readyz")[0] == 200, 60, f"{replica.name} ready again")

    def unconfirmed() -> float:
        total = 0.0
        for replica in world.replicas:
            status, text = replica.get("/metrics")
            for line in text.decode().splitlines() if status == 200 else ():
                if line.startswith("gpushared_extender_unconfirmed_binds "):
                    total += float(line.split()[1])
        return total

    wait(lambda: unconfirmed() == 0, 60, "every bind confirmed")
