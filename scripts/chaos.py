"""The fault suite: the extender under concurrent load while the world around it breaks (``make chaos``).

Each scenario starts a fake API server with GPU nodes and two extender replicas (leader election, mutual
TLS, as deploy/ ships them), schedules more pods than the cluster holds (an over-commit attempt: their
requests add up to at least 1.25 times its GPU memory) from several threads as kube-scheduler does
(filter, pick a passing node, bind; filter again after a refusal), breaks something while it does, mends
it, waits for the extenders to settle, and then counts from the API server's own objects, never from the
extenders' books or answers:

- GPUs over capacity (the bound pods' allocations against each GPU's memory as its daemon published it;
  for pods whose annotations a scenario forged, the allocation their Binding wrote, which is where their
  containers run);
- pods bound without a GPU allocation, and pods with one but unbound;
- binds lost (the extender answered success, the pod is not bound there) and unauthenticated binds
  (pods bound where a caller without the scheduler's certificate asked);
- answers 500 or worse from the verbs;
- /healthz probes (every 20 ms, 1 s timeout) that failed or timed out while the replica ran, and the
  slowest that answered.

Each scenario has a deadline (``--deadline``, 300 s): one that does not finish in time is a failure
("hung"), its processes are killed and the next scenario runs. The last scenario drives the node daemon and
counts from what the kubelet got.

    .venv/bin/python scripts/chaos.py [--pods 200] [--nodes 30] [--threads 8] [--only NAME ...] [--json FILE]

docs/reliability.md has the table and what each scenario does. The exit status is 1 if any count is not 0.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import random
import re
import signal
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpushared import contract
from gpushared.contract import MemoryUnit
from gpushared.core.shared.ledger import Ledger, holding_from_pod
from tests.builders import GPU_MEM, pod
from tests.extender_harness import Extender, gpu_node
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.harness import NODE
from tests.pki import Authority, Pair


@dataclass
class Outcome:
    scenario: str
    pods: int = 0
    bound: int = 0
    over_capacity: list[str] = field(default_factory=list)
    bound_without_allocation: list[str] = field(default_factory=list)
    annotated_but_unbound: list[str] = field(default_factory=list)
    lost_binds: list[str] = field(default_factory=list)
    unauthenticated_binds: list[str] = field(default_factory=list)
    #: verbs answered 500 or worse (a caller's bad input gets 4xx or an error in the body, never that)
    server_errors: list[str] = field(default_factory=list)
    #: /healthz probes of a running replica that failed or took longer than PROBE_TIMEOUT
    healthz_failures: list[str] = field(default_factory=list)
    #: the scenario did not finish within --deadline
    hung: bool = False
    #: what the pods asked for over what the cluster's GPUs hold
    demand_ratio: float = 0.0
    healthz_max_ms: float = 0.0
    #: the longest either extender's event loop was held (its own probe): what blocks /healthz
    loop_lag_max_ms: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: a failover with pods waiting: seconds from Ready (or the takeover) to the first bind and to the last
    #: fitting pod's, and the pods bound of those waiting, as the API server's objects show them
    recovery: dict[str, float] = field(default_factory=dict)
    #: what broke the promise of the failover scenarios (first bind within 5 s, every fitting pod in 30 s)
    outage: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (
            self.outage
            or self.over_capacity
            or self.bound_without_allocation
            or self.annotated_but_unbound
            or self.lost_binds
            or self.unauthenticated_binds
            or self.server_errors
            or self.healthz_failures
            or self.hung
        )


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


# --- what each scenario breaks, called with the load's progress (pods done) -----------------------------------


class Breaker:
    """Breaks the world when the load reaches ``at`` pods, mends it at ``until``; ``notes`` say what it did."""

    def __init__(self, world: World, total: int) -> None:
        self.world, self.total = world, total
        self.notes: list[str] = []
        self.broken = self.mended = False

    def progress(self, done: int) -> None:
        if not self.broken and done >= self.total * 0.2:
            self.broken = True
            self.break_()
        elif self.broken and not self.mended and done >= self.total * 0.6:
            self.mended = True
            self.mend()

    def break_(self) -> None: ...

    def mend(self) -> None: ...

    def finish(self) -> None:
        if not self.mended:
            self.mended = True
            self.mend()


class WatchStalled(Breaker):
    def break_(self) -> None:
        self.world.api.stall_watches()
        time.sleep(8)  # past --watch-seconds + its grace (5 + 10 s from the start of the last watch)

    def mend(self) -> None:
        self.world.api.stall_watches(False)


class WatchCut(Breaker):
    def break_(self) -> None:
        for _ in range(10):
            self.world.api.cut_watches()
            time.sleep(0.3)


class Watch410(Breaker):
    def break_(self) -> None:
        for _ in range(5):
            self.world.api.compact()
            self.world.api.expire_watches()
            time.sleep(0.5)


class Bindings(Breaker):
    """A fault on the Bindings of pods whose names end in one of ``digits``, while broken."""

    def __init__(self, world: World, total: int, **fault: Any) -> None:
        super().__init__(world, total)
        self.fault = Fault(method="POST", path=r"/pods/p-\d*[37]/binding$", times=None, **fault)

    def break_(self) -> None:
        self.world.api.inject(self.fault)

    def mend(self) -> None:
        self.world.api.faults.remove(self.fault)
        self.notes.append(f"{self.fault.hits} Bindings hit")


class ExtenderKill(Breaker):
    def __init__(self, world: World, total: int, *, leader: bool) -> None:
        super().__init__(world, total)
        self.leader = leader

    def break_(self) -> None:
        victim = self.world.leader() if self.leader else self.world.replicas[0]
        victim = victim or self.world.replicas[0]
        self.world.kill(victim)
        self.notes.append(f"killed replica {victim.name} with SIGKILL")
        self.victim = victim
        if not self.leader:
            self.world.restart(victim)

    def mend(self) -> None:
        if self.leader:
            self.world.restart(self.victim)


class Hostile(Breaker):
    """Callers that are not kube-scheduler, from the start of the load to its end (and for 10 s at least):
    bodies that once stalled or crashed the extender, generated junk, and binds without a client
    certificate."""

    def __init__(self, world: World, total: int) -> None:
        super().__init__(world, total)
        self.broken = True
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._attack, daemon=True)
        self.thread.start()

    def progress(self, done: int) -> None:
        pass

    def mend(self) -> None:
        time.sleep(max(0.0, 10 - (time.monotonic() - self.started)))
        self.stop.set()
        self.thread.join()

    def _attack(self) -> None:
        rng = random.Random(5)
        stranger = [
            Extender(api=None, workdir=self.world.work, port=r.port, ca=self.world.pki.cert)
            for r in self.world.replicas
        ]
        trusted = self.world.replicas
        sent = 0
        while not self.stop.is_set():
            huge = pod("huge", 1)
            huge["spec"]["containers"][0]["resources"] = {"limits": {GPU_MEM: rng.choice(["1e999999", "9" * 70])}}
            junk: dict[str, Any] = pod("junk", 1)
            junk["spec"]["containers"] = rng.choice(["main", ["main"], [{"resources": []}], 7])
            target = rng.choice(self.world.api.objects("pods"))
            forged_bind = {
                "PodName": target["metadata"]["name"],
                "PodNamespace": "default",
                "PodUID": target["metadata"]["uid"],
                "Node": rng.choice(self.world.nodes),
            }
            with self.world.lock:  # counted from the API server at the end: is the pod bound where it asked?
                self.world.forged_binds.setdefault(forged_bind["PodName"], forged_bind["Node"])
            for replica, body, verb in (
                (rng.choice(trusted), {"Pod": huge, "NodeNames": self.world.nodes}, "filter"),
                (rng.choice(trusted), {"Pod": pod("many", 1), "NodeNames": ["n"] * 20_000}, "filter"),
                (rng.choice(trusted), {"Pod": junk, "NodeNames": self.world.nodes}, "prioritize"),
                (rng.choice(trusted), {**forged_bind, "PodName": "../../nodes/x"}, "bind"),
                (rng.choice(stranger), forged_bind, "bind"),
            ):
                status, result = replica.post(verb, body)
                sent += 1
                if verb == "bind" and status == 200 and isinstance(result, dict) and result.get("Error") == "":
                    self.notes.append(f"a bind without a certificate was answered as done: {forged_bind}")
                if status >= 500 and status != 503:
                    with self.world.lock:
                        self.world.server_errors.append(f"hostile {verb} answered {status}")
            time.sleep(0.05)
        self.notes.append(f"{sent} hostile requests")


class Forged(Breaker):
    """Owners of bound pods edit their allocation: to 0, and to another GPU."""

    def break_(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.world.api.client())
        with self.world.lock:
            victims = list(self.world.written.items())[:20]
        for i, (name, written) in enumerate(victims):
            allocation = written.get(contract.POD_ALLOCATION, "")
            if i % 2:
                forged = allocation.replace('"amount":', '"amount":0,"was":')
            else:
                forged = allocation.replace('"index":', '"index":1,"was":')
            patch = {"metadata": {"annotations": {contract.POD_ALLOCATION: forged, contract.ALIYUN_GPU_MEM_POD: "0"}}}
            core.patch_namespaced_pod(name, "default", patch)
        self.notes.append(f"forged the allocation of {len(victims)} bound pods")


class BindingsUnderChurn(Bindings):
    """Bindings answered 500 while every watch is cut, again and again, for ``--churn-seconds``: the event
    loop settling binds and the pod informer applying events once deadlocked each other here (30-42 s in, 2
    of 2 runs). Throughout, a few bound pods are deleted each round and as many of the same sizes created
    and scheduled, so Bindings (a fifth of them answered 500), their read-backs, relists and deletions keep
    meeting on the extender's loop for as long as the window lasts (issue #40 runs it for minutes). The
    fault is mended only when the churn ends."""

    def __init__(self, world: World, total: int) -> None:
        super().__init__(world, total, status=500)
        self._churning = threading.Thread(target=self._churn, name="churn", daemon=True)
        self.rounds = self.deleted = self.left_waiting = 0

    def break_(self) -> None:
        super().break_()
        self._churning.start()

    def mend(self) -> None:
        if self._churning.ident is not None:  # started by break_
            self._churning.join()
        super().mend()
        self.notes.append(
            f"{self.rounds} rounds in {self.world.args.churn_seconds:g} s: watches cut, "
            f"{self.deleted} bound pods deleted and as many created and scheduled ({self.left_waiting} of those "
            "still waiting for room at the end)"
        )

    def _churn(self) -> None:
        from kubernetes import client

        world = self.world
        core = client.CoreV1Api(world.api.client())
        rng = random.Random(world.args.seed)
        ends = time.monotonic() + world.args.churn_seconds
        waiting: list[dict[str, Any]] = []
        while time.monotonic() < ends:
            world.api.cut_watches()
            bound = [
                p
                for p in world.api.objects("pods")
                if p["spec"].get("nodeName") and p["metadata"]["name"] in world.told
            ]
            fresh = []
            for body in rng.sample(bound, min(CHURN_PODS, len(bound))):
                name = body["metadata"]["name"]
                core.delete_namespaced_pod(name, "default")
                with world.lock:
                    world.told.pop(name, None)
                    world.written.pop(name, None)
                self.deleted += 1
                size = sum(int(c["resources"]["limits"][GPU_MEM]) for c in body["spec"]["containers"])
                # digits only after "p-", the round's last: a fifth of these Bindings are answered 500 too
                fresh.append(world.api.create(pod(f"p-8{len(fresh)}{self.rounds:05d}", size)))
            # as kube-scheduler does, a pod that found no room yet (its predecessor's deletion not seen, a
            # Binding answered 500 still reserved) is tried again in the next rounds
            waiting = [*waiting, *fresh]
            schedule(world, waiting, threads=CHURN_PODS, progress=lambda _: None)
            waiting = [b for b in waiting if b["metadata"]["name"] not in world.told]
            self.rounds += 1
            time.sleep(0.3)
        self.left_waiting = len(waiting)


#: Bound pods deleted, and pods of their sizes created and scheduled, per round of the churn.
CHURN_PODS = 3


class BindingInFlight(Breaker):
    """A Binding held at the API server while its extender dies. The suite binds pod ``inflight`` to a node
    with one GPU, as large as the GPU's free memory, through the leader, with that Binding held 6 s and then
    applied; while it is held the leader is killed (kill -9, started again at once) or stopped (SIGSTOP
    for 8 s: the follower takes the Lease meanwhile). Then it asks the new leader to bind a pod of the same
    size to the same node, as kube-scheduler would once the node looks free again. Before the fence the
    new leader bound it, and the first Binding landed on top: 20/16 GiB."""

    def __init__(self, world: World, total: int, *, stop: bool) -> None:
        super().__init__(world, total)
        self.stop = stop

    def break_(self) -> None:
        world = self.world
        leader = world.leader() or world.replicas[0]
        node, room = self._node_with_room(leader)
        if node is None:
            self.notes.append("no node with room: nothing held")
            return
        first = world.api.create(pod("inflight", room))
        second = world.api.create(pod("inflight-again", room))
        fault = Fault(method="POST", path=r"/pods/inflight/binding$", delay=6.0, times=1)
        world.api.inject(fault)
        answer: list[Any] = []
        threading.Thread(target=lambda: answer.append(leader.bind(first, node)), daemon=True).start()
        wait(lambda: fault.hits > 0 or answer, 30, "the Binding held at the API server")
        if not fault.hits:
            self.notes.append(f"the leader did not write the Binding: {answer}")
            return
        assert leader.process is not None
        if self.stop:
            world.stopped.add(leader.name)
            leader.process.send_signal(signal.SIGSTOP)
            self.notes.append(f"stopped leader {leader.name} (SIGSTOP) with a Binding of {room} GiB to {node} held")
        else:
            world.kill(leader)
            self.notes.append(f"killed leader {leader.name} (SIGKILL) with a Binding of {room} GiB to {node} held")
            world.restart(leader)
        held_until = time.monotonic() + 6.5
        other = next(r for r in world.replicas if r is not leader)
        # kube-scheduler trying the same room again once someone leads: the follower once the Lease (3 s) is
        # its own, or the killed leader started again, whichever takes it
        wait(lambda: world.leader() not in (None, leader) or not self.stop, 15, "a new leader")
        deadline_at = max(held_until, time.monotonic() + 2)
        answers = []
        while time.monotonic() < deadline_at:
            replica = world.leader() or other
            status, result = replica.bind(second, node)
            answers.append((status, (result or {}).get("Error", "") if isinstance(result, dict) else result))
            if status == 200 and result == {"Error": ""}:
                with world.lock:
                    world.told["inflight-again"] = node
                break
            time.sleep(0.3)
        fenced = sum(1 for _, error in answers if "may still have in flight" in str(error))
        self.notes.append(f"the second bind was refused {fenced} times as fenced; last answer {answers[-1:]}")
        time.sleep(max(0.0, deadline_at - time.monotonic()))  # the held Binding has landed by now
        if self.stop:
            leader.process.send_signal(signal.SIGCONT)
            world.stopped.discard(leader.name)
        where = {
            name: (world.api.get("pods", name, "default") or {}).get("spec", {}).get("nodeName")
            for name in ("inflight", "inflight-again")
        }
        self.notes.append(f"then: {where}")

    def _node_with_room(self, leader: Extender) -> tuple[str | None, int]:
        """A node with one GPU and free memory on it, as the leader counts it (its binds included): the held
        Binding and a second pod of its size can only go to that GPU."""
        for name, inventory in sorted(self.world.inventories.items(), key=lambda item: len(item[1].gpus)):
            if len(inventory.gpus) != 1:
                continue
            status, report = leader.inspect(name)
            if status != 200:
                continue
            [gpu] = report["nodes"][0]["devs"]
            room = gpu["totalGPU"] - gpu["usedGPU"]
            if room > 0:
                return name, room
        return None, 0


#: GPU pods waiting when the replicas restart or the leader is taken over from (issue #52, item 10), and the
#: promise: the first bound within FIRST_BIND_SECONDS of Ready or the takeover, every one that fits within
#: RECOVERY_SECONDS.
WAITING_PODS, FIRST_BIND_SECONDS, RECOVERY_SECONDS = 100, 5.0, 30.0


class WaitingAtFailover(Breaker):
    """``WAITING_PODS`` pods of 1 GiB created, then every replica killed (kill -9) and started again, or the
    leader killed and the follower left to take over; kube-scheduler then binds them, beside the load. Timed
    from the API server's objects (a poll every 50 ms): before issue #52 the fence held every bind for its
    whole window (120 s by default) after a restart or a takeover."""

    def __init__(self, world: World, total: int, *, takeover: bool) -> None:
        super().__init__(world, total)
        self.takeover = takeover
        self.victim: Extender | None = None
        self.recovery: dict[str, float] = {}
        self.outage: list[str] = []

    def break_(self) -> None:
        world = self.world
        waiting = [world.api.create(pod(f"w-{i:03d}", 1)) for i in range(WAITING_PODS)]
        if self.takeover:
            self.victim = leader = world.leader() or world.replicas[0]
            world.kill(leader)
            wait(lambda: world.leader() not in (None, leader), 30, "the follower takes the Lease")
            self.notes.append(f"killed leader {leader.name} with {WAITING_PODS} pods waiting")
        else:
            for replica in world.replicas:
                world.kill(replica)
            killed = time.monotonic()
            for replica in world.replicas:
                world.restart(replica)

            def leading_and_ready() -> bool:
                """A replica says it leads (its gauge: the Lease names the killed processes' ports too)."""
                for replica in world.replicas:
                    status, text = replica.get("/metrics")
                    if status == 200 and b"\ngpushared_extender_leader 1.0" in text:
                        return replica.get("/readyz")[0] == 200
                return False

            # Ready to bind: a replica of the new processes holds the Lease (their identities are new: the
            # killed holder's Lease runs out first) and has synced
            wait(leading_and_ready, 60, "a new leader ready")
            self.notes.append(
                f"killed and restarted both replicas with {WAITING_PODS} pods waiting; a new leader ready "
                f"{time.monotonic() - killed:.1f} s after the kill"
            )
        since = time.monotonic()
        names = {b["metadata"]["name"] for b in waiting}
        seen: dict[str, float] = {}
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                now = time.monotonic()
                for body in world.api.objects("pods"):
                    name = body["metadata"]["name"]
                    if name in names and name not in seen and body["spec"].get("nodeName"):
                        seen[name] = now
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        retry_until_bound(world, waiting, until=since + RECOVERY_SECONDS)
        wait(lambda: len(seen) == len(names) or time.monotonic() > since + RECOVERY_SECONDS, 60, "the waiting pods")
        stop.set()
        watcher.join()
        room = free_gpu_memory(world)
        unbound = sorted(names - seen.keys())
        self.recovery = {
            "first_bind_s": round(min(seen.values()) - since, 2) if seen else -1.0,
            "last_bind_s": round(max(seen.values()) - since, 2) if seen else -1.0,
            "bound": len(seen),
            "waiting": len(names),
        }
        self.notes.append(
            f"first bind {self.recovery['first_bind_s']} s after {'the takeover' if self.takeover else 'it'}, "
            f"{len(seen)}/{len(names)} bound, the last at {self.recovery['last_bind_s']} s"
        )
        if not seen or min(seen.values()) - since > FIRST_BIND_SECONDS:
            self.outage.append(f"first bind {self.recovery['first_bind_s']} s (promise {FIRST_BIND_SECONDS:g})")
        late = [n for n, at in seen.items() if at - since > RECOVERY_SECONDS]
        if (unbound and room) or late:
            self.outage.append(f"{len(unbound)} unbound with {room} GiB free, {len(late)} bound past 30 s")

    def mend(self) -> None:
        if self.victim is not None:
            self.world.restart(self.victim)


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


#: What tenants write into the annotations the contract reads (issue #39): each would once crash the daemon
#: or stop the extender's ledger rebuild, or answer 500.
POISONS = {
    contract.ALIYUN_GPU_MEM_IDX: "1" * 5000,
    contract.POD_ALLOCATION: '{"version":1,"unit":"GiB","containers":[{"name":"c0","gpus":[{"index":'
    + "1" * 5000
    + ',"uuid":"x","amount":1}]}]}',
    contract.POD_MPS_THREAD_PERCENTAGE: "9" * 9000,
    contract.ALIYUN_FRAMEWORK_ALLOCATION: "{}",
    contract.ALIYUN_GPU_MEM_POD: "[" * 50_000,
}


class Poisoned(Breaker):
    """Poisoned annotations on create and on edit. Before the load: pods created bound to nodes (around the
    extender) with each poison, and pending pods with each. At the break: the owners of 20 pods the load
    bound write the poisons into them, one replica is killed and started again (its ledgers are rebuilt
    from those pods: the rebuild once stopped at a poisoned pod and forgot the rest), and the pending
    poisoned pods are filtered, prioritized and bound (once answered 500)."""

    def __init__(self, world: World, total: int) -> None:
        super().__init__(world, total)
        self.pending = []
        for i, (key, value) in enumerate(POISONS.items()):
            world.api.create(pod(f"poisoned-bound-{i}", 1, node=world.nodes[i], annotations={key: value}))
            world.bypassed.add(f"poisoned-bound-{i}")
            self.pending.append(world.api.create(pod(f"poisoned-{i}", 2, annotations={key: value})))
            world.bypassed.add(f"poisoned-{i}")  # created with its annotations by its owner, not by a bind

    def break_(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.world.api.client())
        with self.world.lock:
            victims = list(self.world.written)[:20]
        for i, name in enumerate(victims):
            key, value = list(POISONS.items())[i % len(POISONS)]
            core.patch_namespaced_pod(name, "default", {"metadata": {"annotations": {key: value}}})
        self.notes.append(f"poisoned the annotations of {len(victims)} bound pods")
        victim = self.world.replicas[0]
        self.world.kill(victim)
        self.world.restart(victim)
        wait(lambda: victim.get("/readyz")[0] == 200, 60, f"{victim.name} ready again")
        for body in self.pending:
            for replica in self.world.replicas:
                for verb, request in (
                    ("filter", {"Pod": body, "NodeNames": self.world.nodes}),
                    ("prioritize", {"Pod": body, "NodeNames": self.world.nodes}),
                ):
                    status, _ = replica.post(verb, request)
                    if status >= 500 and status != 503:
                        with self.world.lock:
                            self.world.server_errors.append(f"{verb} of {body['metadata']['name']}: {status}")
                status, _ = replica.bind(body, self.world.nodes[0])
                if status >= 500 and status != 503:
                    with self.world.lock:
                        self.world.server_errors.append(f"bind of {body['metadata']['name']}: {status}")


SCENARIOS: dict[str, Callable[[World, int], Breaker]] = {
    "baseline": Breaker,
    "watch stalled (open, silent)": WatchStalled,
    "watch cut": WatchCut,
    "watch 410 Gone": Watch410,
    "Bindings answered 500": lambda w, n: Bindings(w, n, status=500),
    "Bindings cut, not applied": lambda w, n: Bindings(w, n, cut=True),
    "Bindings applied, answer cut": lambda w, n: Bindings(w, n, cut=True, applied=True),
    "Bindings applied, answered after the client gave up": lambda w, n: Bindings(
        w, n, applied=True, delay=10.5, status=504
    ),
    "Bindings slow (3 s)": lambda w, n: Bindings(w, n, delay=3.0),
    "Bindings answered 500 under watch churn": BindingsUnderChurn,
    "extender kill -9 and restart": lambda w, n: ExtenderKill(w, n, leader=False),
    "leader kill -9": lambda w, n: ExtenderKill(w, n, leader=True),
    "leader kill -9 with a Binding in flight": lambda w, n: BindingInFlight(w, n, stop=False),
    "leader SIGSTOP with a Binding in flight": lambda w, n: BindingInFlight(w, n, stop=True),
    "restart with 100 pods waiting": lambda w, n: WaitingAtFailover(w, n, takeover=False),
    "takeover with 100 pods waiting": lambda w, n: WaitingAtFailover(w, n, takeover=True),
    "hostile callers": Hostile,
    "forged annotations": Forged,
    "poisoned annotations on create and edit": Poisoned,
}


#: The pods of a scenario ask for at least this much of the cluster's GPU memory.
OVERCOMMIT = 1.25


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


def run(name: str, args: argparse.Namespace, work: Path, pki: Authority, pairs: dict[str, Pair]) -> Outcome:
    outcome = Outcome(scenario=name, pods=args.pods)
    started = time.monotonic()
    try:
        with deadline(args.deadline):
            _run(name, outcome, args, work=work, pki=pki, pairs=pairs)
    except Hung:
        outcome.hung = True
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


def _run(
    name: str, outcome: Outcome, args: argparse.Namespace, *, work: Path, pki: Authority, pairs: dict[str, Pair]
) -> None:
    world = World(args, work / name.replace(" ", "-"), pki, pairs)
    try:
        rng = random.Random(args.seed)
        capacity = sum(inventory.total for inventory in world.inventories.values())
        sizes = [rng.randint(1, 12) for _ in range(args.pods)]
        while sum(sizes) < OVERCOMMIT * capacity:  # more than fits: every scenario tries to over-commit
            sizes.append(rng.randint(1, 12))
        outcome.pods, outcome.demand_ratio = len(sizes), round(sum(sizes) / capacity, 2)
        bodies = [world.api.create(pod(f"p-{i:04d}", size)) for i, size in enumerate(sizes)]
        breaker = SCENARIOS[name](world, len(bodies))
        with healthz_probe(world) as (slowest, failures):
            schedule(world, bodies, threads=args.threads, progress=breaker.progress)
            breaker.finish()
            settle(world)
            # kube-scheduler keeps retrying the pods it could not place: once more for those still unbound,
            # now that the reservations of lost Bindings have settled
            unbound = [b for b in bodies if not (world.api.get("pods", b["metadata"]["name"], "default") or {})
                       .get("spec", {}).get("nodeName")]  # fmt: skip
            schedule(world, unbound, threads=args.threads, progress=lambda _: None)
            settle(world)
            outcome.loop_lag_max_ms = max(loop_lag(r) for r in world.replicas)
        outcome.healthz_max_ms = round(slowest[0] * 1000, 1)
        outcome.healthz_failures = failures[:20] + ([f"... {len(failures) - 20} more"] if len(failures) > 20 else [])
        outcome.notes = breaker.notes
        if isinstance(breaker, WaitingAtFailover):
            outcome.recovery, outcome.outage = breaker.recovery, breaker.outage
        count(world, outcome)
    except Hung:
        outcome.notes.append(f"did not finish within {args.deadline} s")
        raise
    finally:
        world.close()


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


def count(world: World, outcome: Outcome) -> None:
    pods = {p["metadata"]["name"]: p for p in world.api.objects("pods")}
    outcome.bound = sum(1 for p in pods.values() if p["spec"].get("nodeName"))
    by_node: dict[str, list[dict[str, Any]]] = {}
    for name, body in pods.items():
        node = body["spec"].get("nodeName")
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        if node and contract.POD_ALLOCATION not in annotations and name not in world.bypassed:
            outcome.bound_without_allocation.append(name)
        if not node and contract.POD_ALLOCATION in annotations and name not in world.bypassed:
            outcome.annotated_but_unbound.append(name)
        if name in world.told and world.told[name] != node:
            outcome.lost_binds.append(f"{name}: told {world.told[name]}, is on {node}")
        if node:
            truth = copy.deepcopy(body)
            if name in world.written:  # where its containers run: what its Binding wrote
                truth["metadata"]["annotations"] = world.written[name]
            by_node.setdefault(node, []).append(truth)
    for node in world.api.objects("nodes"):
        name = node["metadata"]["name"]
        # the GPUs as the node's daemon found them (a scenario may forge the annotation on the API server)
        inventory = world.inventories.get(name) or contract.parse_inventory(
            node["metadata"]["annotations"][contract.NODE_INVENTORY]
        )
        ledger = Ledger.build(inventory)
        for body in by_node.get(name, []):
            holding = holding_from_pod(body, unit=MemoryUnit.GIB)  # type: ignore[arg-type]
            if holding is not None:
                ledger.add(holding)
        outcome.over_capacity += [
            f"{name} GPU {g.index}: {ledger.used(g.index)}/{g.memory}"
            for g in inventory.gpus
            if ledger.used(g.index) > g.memory
        ]
    outcome.unauthenticated_binds = [
        f"{name} -> {node}"
        for name, node in world.forged_binds.items()
        if (pods.get(name) or {}).get("spec", {}).get("nodeName") == node and world.told.get(name) != node
    ]
    outcome.server_errors = list(world.server_errors)


# --- the node daemon: the kubelet admitting pods while the API server hangs and a GPU is lost -----------------


@dataclass
class NodeOutcome:
    scenario: str
    containers: int = 0
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    wrong_gpu: list[str] = field(default_factory=list)
    #: GPUs given more memory than they have, summed from what the kubelet's containers were given
    over_capacity: list[str] = field(default_factory=list)
    #: pods annotated for a GPU without room (as a broken or forged placement would) that got it anyway
    overcommits_admitted: list[str] = field(default_factory=list)
    overcommits_tried: int = 0
    #: times the daemon process exited (poisoned pods once crash-looped it)
    daemon_exits: int = 0
    #: forged inventories still on the Node 5 s after the edit
    forgeries_left: list[str] = field(default_factory=list)
    #: connections to the metrics port held open while Allocate went on
    connections_held: int = 0
    hung: bool = False
    allocate_max_ms: float = 0.0
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (
            self.wrong_gpu
            or self.over_capacity
            or self.overcommits_admitted
            or self.daemon_exits
            or self.forgeries_left
            or self.hung
        )


def run_node_within(args: argparse.Namespace, work: Path) -> NodeOutcome:
    outcome = NodeOutcome(scenario=NODE_SCENARIO)
    started = time.monotonic()
    try:
        with deadline(args.deadline):
            run_node(args, work, outcome)
    except Hung:
        outcome.hung = True
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


NODE_SCENARIO = (
    "node daemon: API server hang during Allocate, NVML error on GPU 3, poisoned pods, 3,000 idle connections, "
    "a forged inventory, over-commits"
)


def run_node(args: argparse.Namespace, work: Path, outcome: NodeOutcome) -> None:
    """One node (4 fake GPUs of 16, 12, 24 and 8 GiB; the daemon under systemd's default limit of 1,024
    descriptors) and pods placed on it as the extender places them, each admitted right after its bind, one
    at a time as the kubelet does. Before the load, pods with poisoned annotations are created on the node.
    A quarter of the way in, the API server hangs for pod reads and the daemon's pod watch stalls (each call
    must answer within its 2 s budget), and 3,000 connections to the metrics port are opened and held;
    half-way, that ends and GPU 3 fails in NVML (GPU_IS_LOST) until three quarters, when someone inflates
    GPU 3 in the node's inventory annotation. Then every refused pod is admitted again, and pods annotated
    for GPUs without room are admitted (an over-commit attempt: each must be refused).

    Counts, from what the kubelet got: containers given another GPU than their allocation names, GPUs
    given more than they have, over-commits admitted; and daemon exits, forgeries still there 5 s on."""
    import socket

    with node_world(work, launcher=["prlimit", "--nofile=1024:1024", "--"]) as daemon:
        plan = plan_for_node(args)
        node = NodeAdmissions(daemon, outcome)
        quarter = max(1, len(plan) // 4)
        hang = Fault(method="GET", path=r"/pods/n-\d+$", delay=30.0, times=None)
        gpu_mem = contract.DEFAULT_RESOURCES.gpu_mem
        for i, (key, value) in enumerate(POISONS.items()):
            daemon.api.create(pod(f"poisoned-{i}", 1 + i % 2, node=NODE, annotations={key: value}))
        held: list[socket.socket] = []
        for i, (amount, gpu) in enumerate(plan):
            if i == quarter:
                daemon.api.stall_watches()
                daemon.api.inject(hang)
                held = hold_connections(daemon.metrics_port, 3000)
                outcome.connections_held = len(held)
            elif i == 2 * quarter:
                daemon.api.faults.remove(hang)
                daemon.api.stall_watches(False)
                for connection in held:
                    connection.close()
                daemon.nvml.gpus[3].errors = {"nvmlDeviceGetMemoryInfo": "GPU_IS_LOST"}
                daemon.nvml.write()
                daemon.kubelet.wait_for(gpu_mem, capacity=52)
            elif i == 3 * quarter:
                daemon.nvml.gpus[3].errors = {}
                daemon.nvml.write()
                daemon.kubelet.wait_for(gpu_mem, capacity=60, timeout=30)
                forge_inventory(daemon, outcome)
            # bound just now, as the extender binds: while the watch is stalled the daemon must read it
            node.admit(daemon.place(f"n-{i:03d}", amount, gpu=gpu), gpu)
        node.admit_refused_again()
        node.overcommit()
        outcome.containers = len(plan)
        outcome.allocate_max_ms = round(max((t for _, t in daemon.kubelet.timings), default=0.0) * 1000, 1)
        outcome.over_capacity = node.over_capacity()
        if daemon.process is not None and daemon.process.poll() is not None:
            outcome.daemon_exits += 1


def hold_connections(port: int, count: int) -> list[Any]:
    """``count`` TCP connections to ``port`` opened and left idle (those the daemon closes at once too)."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 4096), hard))
    held = []
    for _ in range(count):
        connection = socket.socket()
        connection.settimeout(0.5)
        try:
            connection.connect(("127.0.0.1", port))
        except OSError:
            connection.close()
            continue
        held.append(connection)
    return held


def forge_inventory(daemon: Any, outcome: NodeOutcome) -> None:
    """Someone inflates GPU 3 (8 GiB) to 80 in the Node's inventory annotation; the daemon's must be back
    within 5 s."""
    from kubernetes import client

    ours = daemon.inventory_annotations()[contract.NODE_INVENTORY]
    inflated = json.loads(ours)
    inflated["gpus"][3]["memory"], inflated["gpus"][3]["memoryMiB"] = 80, 80 * 1024
    core = client.CoreV1Api(daemon.api.client())
    core.patch_node(NODE, {"metadata": {"annotations": {contract.NODE_INVENTORY: json.dumps(inflated)}}})
    deadline_at = time.monotonic() + 5
    while time.monotonic() < deadline_at:
        shown = json.loads(daemon.inventory_annotations()[contract.NODE_INVENTORY])
        if shown["gpus"][3]["memory"] == 8:
            return
        time.sleep(0.1)
    outcome.forgeries_left.append("GPU 3 still 80 GiB in the inventory 5 s after the edit")


@contextmanager
def node_world(work: Path, *, launcher: list[str] | None = None) -> Iterator[Any]:
    """The daemon serving, registered with the fake kubelet, its inventory on the Node."""
    from tests.fakes.kubelet import FakeKubelet
    from tests.fakes.nvml import FakeNvml, build_library
    from tests.fakes.systemd import NotifySocket
    from tests.harness import Daemon, node_body

    work.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gps-", dir="/tmp"))  # short: unix socket paths
    (root / "device-plugins").mkdir()
    library = build_library(work / "fake-nvml")
    with FakeApiServer() as api, FakeKubelet(root, seed=1) as kubelet:
        api.create(node_body())
        notify = NotifySocket(root / "notify.sock")
        nvml = FakeNvml.with_sizes(work / "nvml.json", library, 16384, 12288, 24576, 8192)
        daemon = Daemon(api=api, kubelet=kubelet, nvml=nvml, notify=notify, workdir=work)
        daemon.launcher = launcher or []
        daemon.start()
        try:
            notify.wait_for("READY=1")
            kubelet.wait_for(contract.DEFAULT_RESOURCES.gpu_mem, capacity=60)
            wait(lambda: contract.NODE_INVENTORY in daemon.inventory_annotations(), 30, "inventory")
            yield daemon
        finally:
            if daemon.process is not None and daemon.process.poll() is None:
                daemon.stop()
            notify.close()


def plan_for_node(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(amount, GPU) of pods of 1-3 GiB on random GPUs with room, as the extender would place them, up to
    three quarters of the node: the rest is room for the over-commit attempts to be the daemon's to refuse
    (the kubelet's own count of devices refuses what the node as a whole has no room for)."""
    rng = random.Random(args.seed)
    room = {0: 16, 1: 12, 2: 24, 3: 8}
    plan = []
    for _ in range(args.node_pods):
        amount = rng.randint(1, 3)
        fits = [g for g, free in room.items() if free >= amount]
        if not fits or sum(room.values()) - amount < 15:
            break
        gpu = rng.choice(fits)
        room[gpu] -= amount
        plan.append((amount, gpu))
    return plan


class NodeAdmissions:
    """The kubelet's admissions, checked: every container on the GPU its allocation names."""

    def __init__(self, daemon: Any, outcome: NodeOutcome) -> None:
        self.daemon, self.outcome = daemon, outcome
        self.uuids = [g.uuid for g in daemon.nvml.gpus]
        self.refused: list[tuple[dict[str, Any], int]] = []
        #: (GPU UUID, GiB) of every container the kubelet was given a GPU for
        self.answers: list[tuple[str, int]] = []

    def admit(self, body: dict[str, Any], gpu: int) -> None:
        from tests.fakes.kubelet import AdmissionError

        name = body["metadata"]["name"]
        try:
            allocations = self.daemon.admit(body)
        except AdmissionError as exc:
            found = re.search(r"\b([A-Z][A-Z_]{4,}):", str(exc))  # the gRPC status the daemon answered
            code = found[1] if found else "kubelet: " + str(exc)[:40]
            self.outcome.refused[code] = self.outcome.refused.get(code, 0) + 1
            self.refused.append((body, gpu))
            # The kubelet marks a pod it rejected Failed and drops it from its pod manager (the daemon refuses
            # to guess while a rejected pod still waits there beside another; design.md §7).
            self.daemon.kubelet.pods.pop(self._uid(body), None)
            return
        self.outcome.admitted += 1
        for allocation in allocations:
            envs = allocation.response.envs
            if envs["NVIDIA_VISIBLE_DEVICES"] != self.uuids[gpu]:
                self.outcome.wrong_gpu.append(f"{name}/{allocation.name}")
            self.answers.append((envs["NVIDIA_VISIBLE_DEVICES"], int(envs[contract.ENV_GPU_MEM_CONTAINER])))

    def overcommit(self) -> None:
        """Pods annotated for each GPU with more than the GPU has left (a broken or forged placement): the
        daemon must refuse every one."""
        free = dict(enumerate((16, 12, 24, 8)))
        for gpu, amount in self.given().items():
            free[gpu] -= amount
        # Only where the node as a whole has room, so the kubelet's own count of devices lets it through and
        # the daemon is the one to refuse.
        for gpu, left in free.items():
            if sum(free.values()) < left + 1:
                continue
            self.outcome.overcommits_tried += 1
            body = self.daemon.place(f"over-{gpu}", left + 1, gpu=gpu)
            before = self.outcome.admitted
            self.admit(body, gpu)
            if self.outcome.admitted > before:
                self.outcome.overcommits_admitted.append(f"over-{gpu}: {left + 1} GiB on GPU {gpu} with {left} left")

    def given(self) -> dict[int, int]:
        """GiB per GPU the kubelet's containers were given, from the answers it got."""
        given: dict[int, int] = {}
        for uuid, amount in self.answers:
            gpu = self.uuids.index(uuid)
            given[gpu] = given.get(gpu, 0) + amount
        return given

    def over_capacity(self) -> list[str]:
        sizes = (16, 12, 24, 8)
        return [f"GPU {gpu}: {amount}/{sizes[gpu]}" for gpu, amount in self.given().items() if amount > sizes[gpu]]

    def admit_refused_again(self) -> None:
        """The pod's controller replaces a refused pod; here the same pod is admitted again."""
        again, self.refused = self.refused, []
        for body, gpu in again:
            self.admit(body, gpu)

    def _uid(self, body: dict[str, Any]) -> str:
        return str((self.daemon.api.get("pods", body["metadata"]["name"], "default") or {})["metadata"]["uid"])


def table(path: Path) -> str:
    """docs/reliability.md's table from a --json file of one or more runs: per scenario, the range of pods
    bound, the largest of each count over the runs, the slowest answers, and the range of seconds."""
    records = json.loads(path.read_text())
    by_name: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_name.setdefault(record["scenario"], []).append(record)
    counts = (
        "over_capacity",
        "bound_without_allocation",
        "annotated_but_unbound",
        "lost_binds",
        "unauthenticated_binds",
        "server_errors",
        "healthz_failures",
    )
    lines = [
        "| scenario | runs | bound | over | without allocation | unbound with allocation | lost | unauthenticated "
        "| 5xx | failed probes | hung | slowest /healthz | loop held | seconds |",
        "|---" * 14 + "|",
    ]
    for name, runs in by_name.items():
        if "containers" in runs[0]:  # the node daemon's: summarized below the table
            continue
        bound = sorted(r["bound"] for r in runs)
        worst = [max(len(r[key]) for r in runs) for key in counts]
        seconds = [r["seconds"] for r in runs]
        lines.append(
            f"| {name} | {len(runs)} | {bound[0]}-{bound[-1]} of {runs[0]['pods']} | "
            + " | ".join(str(w) for w in worst)
            + f" | {sum(r['hung'] for r in runs)} | {max(r['healthz_max_ms'] for r in runs):.1f} ms"
            f" | {max(r['loop_lag_max_ms'] for r in runs):.1f} ms | {min(seconds):.1f}-{max(seconds):.1f} |"
        )
    failovers = [r for r in records if r.get("recovery")]
    if failovers:
        lines.append("")
        for name in dict.fromkeys(r["scenario"] for r in failovers):
            runs = [r["recovery"] for r in failovers if r["scenario"] == name]
            lines.append(
                f"{name}, {len(runs)} runs: first bind {min(r['first_bind_s'] for r in runs):.1f}-"
                f"{max(r['first_bind_s'] for r in runs):.1f} s after Ready or the takeover; "
                f"{min(r['bound'] for r in runs):.0f}-{max(r['bound'] for r in runs):.0f} of "
                f"{runs[0]['waiting']:.0f} bound, the last at {max(r['last_bind_s'] for r in runs):.1f} s; "
                f"broken promises {sum(len(r.get('outage', [])) for r in failovers if r['scenario'] == name)}."
            )
    nodes = [r for r in records if "containers" in r]
    if nodes:
        lines += [
            "",
            f"Node daemon, {len(nodes)} runs: pods admitted {min(r['admitted'] for r in nodes)}-"
            f"{max(r['admitted'] for r in nodes)} of {nodes[0]['containers']}; containers on another GPU "
            f"{max(len(r['wrong_gpu']) for r in nodes)}; GPUs over capacity (kubelet's answers) "
            f"{max(len(r['over_capacity']) for r in nodes)}; over-commits admitted "
            f"{max(len(r['overcommits_admitted']) for r in nodes)} of {nodes[0]['overcommits_tried']} tried; "
            f"connections held {min(r['connections_held'] for r in nodes)}-"
            f"{max(r['connections_held'] for r in nodes)}; "
            f"daemon exits {sum(r['daemon_exits'] for r in nodes)}; forged inventories left "
            f"{max(len(r['forgeries_left']) for r in nodes)}; hung {sum(r['hung'] for r in nodes)}; slowest "
            f"Allocate {max(r['allocate_max_ms'] for r in nodes):.0f} ms; "
            f"{min(r['seconds'] for r in nodes):.0f}-{max(r['seconds'] for r in nodes):.0f} s.",
        ]
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--table"]:
        print(table(Path(sys.argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=30)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", nargs="*", help="scenarios whose name contains one of these words")
    parser.add_argument("--node-pods", type=int, default=40, help="pods admitted in the node daemon's scenario")
    parser.add_argument("--json", type=Path, help="write the outcomes here too")
    parser.add_argument("--deadline", type=int, default=300, help="seconds a scenario may take; past them it hung")
    parser.add_argument("--runs", type=int, default=1, help="run every scenario this many times in a row")
    parser.add_argument(
        "--churn-seconds", type=float, default=5.0, help="how long the watch churn under Bindings answered 500 lasts"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpushared-chaos-"))
    pki = Authority(work / "pki")
    pairs = {
        "extender": pki.issue("extender", common_name="gpushared-extender", server=True),
        "scheduler": pki.issue("scheduler", common_name="system:kube-scheduler"),
    }
    names = [n for n in SCENARIOS if not args.only or any(word in n for word in args.only)]
    outcomes = []
    print(f"{'scenario':<54} {'bound':>7} {'over':>5} {'no-alloc':>8} {'unbound':>7} {'lost':>5} {'unauth':>6} "
          f"{'5xx':>4} {'probes':>6} {'healthz':>9} {'loop':>8} {'secs':>6}")  # fmt: skip
    nodes: list[NodeOutcome] = []

    def save() -> None:
        """The outcomes so far into --json, after every scenario: a long series stopped early keeps its runs."""
        if args.json:
            records = [o.__dict__ for o in outcomes] + [node.__dict__ for node in nodes]
            args.json.write_text(json.dumps(records, indent=1) + "\n")

    for run_number in range(args.runs):
        if args.runs > 1:
            print(f"--- run {run_number + 1} of {args.runs}", flush=True)
        for name in names:
            outcome = run(name, args, work, pki, pairs)
            outcomes.append(outcome)
            save()
            print(
                f"{name:<54} {outcome.bound:>3}/{outcome.pods:<3} {len(outcome.over_capacity):>5} "
                f"{len(outcome.bound_without_allocation):>8} {len(outcome.annotated_but_unbound):>7} "
                f"{len(outcome.lost_binds):>5} {len(outcome.unauthenticated_binds):>6} "
                f"{len(outcome.server_errors):>4} {len(outcome.healthz_failures):>6} "
                f"{outcome.healthz_max_ms:>7.1f}ms {outcome.loop_lag_max_ms:>6.1f}ms {outcome.seconds:>6.1f}"
                + ("  HUNG" if outcome.hung else ""),
                flush=True,
            )
            problems = (
                outcome.outage
                + outcome.over_capacity
                + outcome.lost_binds
                + outcome.unauthenticated_binds
                + outcome.server_errors
                + outcome.healthz_failures
                + outcome.notes
            )
            for problem in problems[:8]:
                print(f"    {problem}")
        if not args.only or any(word in "node daemon" for word in args.only):
            node = run_node_within(args, work / f"node-{run_number}")
            nodes.append(node)
            save()
            print(f"\n{node.scenario}: {node.admitted}/{node.containers} pods admitted, refused meanwhile "
                  f"{node.refused}; containers on another GPU than their allocation: {len(node.wrong_gpu)}; GPUs "
                  f"over capacity (what the kubelet got): {len(node.over_capacity)}; over-commits admitted: "
                  f"{len(node.overcommits_admitted)} of {node.overcommits_tried}; {node.connections_held} connections "
                  f"held; daemon exits: {node.daemon_exits}; inventory forgeries "
                  f"left: {len(node.forgeries_left)}; slowest Allocate {node.allocate_max_ms} ms; {node.seconds} s"
                  + ("  HUNG" if node.hung else ""))  # fmt: skip
            for problem in (node.wrong_gpu + node.over_capacity + node.overcommits_admitted + node.forgeries_left)[:8]:
                print(f"    {problem}")
    save()
    clean = all(o.clean for o in outcomes) and all(node.clean for node in nodes)
    print("all counts 0" if clean else "SOME COUNTS ARE NOT 0", f"(work files in {work})")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
