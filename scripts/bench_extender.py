"""Extender speed: filter, prioritize and bind latency, in-process and over loopback HTTP, and memory.

An API server holds ``--nodes`` gpushared nodes of 8 GPUs of 16 GiB and ``--pods`` running pods already placed
on them (1-4 GiB each, packed by the extender's own binpack, so the ledgers look like a busy cluster's): the
fake one (tests/fakes/apiserver.py, HTTP on loopback, in this process), or with ``--apiserver real`` the
real kube-apiserver 1.20 and etcd of tests/e2e's local cluster (started for the run, without controllers
or kubelet). Then:

- in-process: the production ClusterCache, synced from that API server through gpushared.kube, and
  the production Scheduler; each pending pod (1-8 GiB) is filtered and prioritized against
  ``--candidates`` node names, as kube-scheduler sends them (``nodeCacheCapable: true``), and bound;
- over HTTP: the real ``gpushared-extender`` process against the same API server, called the way
  kube-scheduler calls it (one keep-alive connection, JSON bodies): filter alone with the cluster at rest,
  then, as in-process, a new pending pod before each round (its watch event reaches the extender as the
  filter does); its RSS is read after its cache synced and at the end;
- sustained: for ``--seconds`` over HTTP, filter of new pods one after another, each bound in the
  background (``--bind-workers`` in flight), as kube-scheduler's serial scheduling cycle and its
  asynchronous binding cycle call the extender; then filters alone for ``--filter-alone-seconds``, to see
  what of the extender's CPU per filter+bind the filter takes.

    .venv/bin/python scripts/bench_extender.py --nodes 1000 --pods 20000 --candidates 1000
    .venv/bin/python scripts/bench_extender.py --nodes 5000 --pods 150000 --candidates 500
    .venv/bin/python scripts/bench_extender.py --nodes 1000 --pods 20000 --candidates 1000 --apiserver real
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import http.client
import json
import multiprocessing
import platform
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchkit.extender_world import GPUS, Backend, FakeBackend, RealBackend, pending, pending_body, populate
from benchkit.measure import percentiles, pin, timed

from gpushared import contract
from gpushared.core.placement.policies import policy_named
from gpushared.core.shared.requests import pod_request
from gpushared.extender.cache import ClusterCache
from gpushared.extender.http.wire import BindingArgs, ExtenderArgs
from gpushared.extender.scheduler import Scheduler
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.api import Api, connect
from tests.e2e.cluster import LocalCluster
from tests.extender_harness import PREFIX, Extender
from tests.fakes.apiserver import FakeApiServer


class InProcess:
    """The verbs called on the production Scheduler directly, on this thread, which owns the cache: the
    informers' changes are applied before each verb, as the extender's loop applies them between verbs."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.inbox = scheduler.cache.inbox
        scheduler.cache.owner.claim()
        self.loop = asyncio.new_event_loop()  # bind is a coroutine, as the extender awaits it

    def filter(self, body: dict[str, Any], names: list[str]) -> list[str]:
        self.inbox.drain()
        return self.scheduler.filter(ExtenderArgs(pod=body, node_names=names, nodes=None)).passed

    def prioritize(self, body: dict[str, Any], names: list[str]) -> Any:
        self.inbox.drain()
        return self.scheduler.prioritize(ExtenderArgs(pod=body, node_names=names, nodes=None))

    def bind(self, body: dict[str, Any], node: str) -> None:
        self.inbox.drain()
        meta = body["metadata"]
        self.loop.run_until_complete(
            self.scheduler.bind(
                BindingArgs(pod_name=meta["name"], pod_namespace=meta["namespace"], pod_uid=meta["uid"], node=node)
            )
        )

    def close(self) -> None:
        self.loop.run_until_complete(self.scheduler.close())
        self.loop.close()


class OverHttp:
    """The verbs posted to the extender process on one keep-alive connection, as kube-scheduler's client does."""

    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, verb: str, body: dict[str, Any]) -> Any:
        self.connection.request("POST", f"{PREFIX}/{verb}", body=json.dumps(body).encode())
        response = self.connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{verb}: {response.status} {data[:200]!r}")
        return json.loads(data)

    def filter(self, body: dict[str, Any], names: list[str]) -> list[str]:
        return list(self.post("filter", {"Pod": body, "NodeNames": names})["NodeNames"] or [])

    def prioritize(self, body: dict[str, Any], names: list[str]) -> Any:
        return self.post("prioritize", {"Pod": body, "NodeNames": names})

    def bind(self, body: dict[str, Any], node: str) -> str:
        """The extender's error for this bind; empty when it bound."""
        meta = body["metadata"]
        answer = self.post(
            "bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}
        )
        return str(answer.get("Error") or "")


Verbs = InProcess | OverHttp


def rounds(
    backend: Backend, verbs: Verbs, names: list[str], args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    """Per round: a pending pod, filter against a sample of the nodes, prioritize what passed, bind.
    ``prioritizeFirstOfSize`` is the prioritize calls for a request size not asked before in these rounds:
    the cold calls, which price every candidate (later calls find most nodes' prices kept).

    ``args.lead``: how many rounds before its own a pod is created, as kube-scheduler's queue holds pods
    before their cycle (0: created right before its filter, the extender seeing it as the filter comes)."""
    filters: list[float] = []
    prioritizes: list[float] = []
    first_of_size: list[float] = []
    binds: list[float] = []
    sizes: set[int] = set()
    tag = type(verbs).__name__.lower()
    queued = collections.deque(pending(backend, f"{tag}-{i:05d}", rng) for i in range(min(args.lead, args.requests)))
    for i in range(args.requests):
        if i + args.lead < args.requests:
            queued.append(pending(backend, f"{tag}-{i + args.lead:05d}", rng))
        body = queued.popleft()
        passed = timed(filters, verbs.filter, body, rng.sample(names, min(args.candidates, len(names))))
        timed(prioritizes, verbs.prioritize, body, passed)
        size = pod_request(body).total
        if size not in sizes:
            sizes.add(size)
            first_of_size.append(prioritizes[-1])
        if passed:
            timed(binds, verbs.bind, body, passed[0])
    return {
        "filter": percentiles(filters),
        "prioritize": percentiles(prioritizes),
        "prioritizeFirstOfSize": percentiles(first_of_size),
        "bind": percentiles(binds),
    }


def in_process(backend: Backend, names: list[str], args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    client = Api(connect(backend.kubeconfig))
    cache = ClusterCache(
        list_nodes=client.rest.lister("/api/v1/nodes", what="nodes"),
        list_pods=client.rest.lister("/api/v1/pods", what="pods"),
        resources=contract.DEFAULT_RESOURCES,
        rooms=policy_named(args.policy).reads_rooms,
    )
    started = time.perf_counter()
    cache.start()
    cache.nodes.wait_synced(600)
    cache.pods.wait_synced(600)
    cache.prepare()  # as the extender does before it says ready: apply what was listed, warm, fence
    synced = time.perf_counter() - started
    policy = policy_named(args.policy)
    binder = AsyncApi(client.rest.credentials)
    verbs = InProcess(
        Scheduler(cache=cache, api=binder, policy=policy, resources=contract.DEFAULT_RESOURCES, rank_in_filter=False)
    )
    try:
        return {"cacheSyncSeconds": round(synced, 2), **rounds(backend, verbs, names, args, rng)}
    finally:
        verbs.close()
        cache.stop()


def over_http(backend: Backend, names: list[str], args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    extender = Extender(
        api=backend.api if isinstance(backend, FakeBackend) else None,
        kubeconfig=backend.kubeconfig,
        workdir=Path(tempfile.mkdtemp(prefix="gps-bench-")),
        # As deployed (debug logs every API call), but with filter passing every node that fits, as the
        # in-process verbs do: filter and prioritize are measured apart (the shipped filter ranks too: its
        # cost is filter's plus prioritize's ranking, docs/benchmarks.md).
        # No fence: the pods the in-process rounds left pending are this benchmark's, with no Binding in
        # flight; an extender that finds pods pending at its start otherwise waits out the landing window.
        args=["--policy", args.policy, "--log-level", "info", "--no-rank-in-filter", "--binding-landing-seconds", "1"],
        cpus=args.extender_cpus,
    )
    extender.start()
    try:
        started = time.perf_counter()
        extender.wait_ready(900)
        synced = time.perf_counter() - started
        assert extender.process is not None
        process = psutil.Process(extender.process.pid)
        rss_synced = process.memory_info().rss
        verbs = OverHttp(extender.port)
        at_rest: list[float] = []  # nothing else happening: no pods created or bound meanwhile
        body = pending(backend, "http-at-rest", rng)
        for _ in range(args.requests):
            timed(at_rest, verbs.filter, body, rng.sample(names, min(args.candidates, len(names))))
        measured = rounds(backend, verbs, names, args, rng)
        measured["slotsPrimed"] = slots_primed(extender.port)  # in the rounds (and the at-rest pod's)
        return {
            "cacheSyncSeconds": round(synced, 2),
            "rssMiBSynced": round(rss_synced / 2**20, 1),
            "filterAtRest": percentiles(at_rest),
            **measured,
            **sustained(backend, names, args, rng, port=extender.port, extender=process),
            "rssMiBAfter": round(process.memory_info().rss / 2**20, 1),
        }
    finally:
        extender.stop()


def slots_primed(port: int) -> int:
    """The extender's ``gpushared_extender_slots_primed_total`` (-1: the extender has no primer)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found = re.search(r"^gpushared_extender_slots_primed_total (\S+)$", text, re.MULTILINE)
    return int(float(found[1])) if found else -1


def sustained(
    backend: Backend,
    names: list[str],
    args: argparse.Namespace,
    rng: random.Random,
    *,
    port: int,
    extender: psutil.Process,
    prefix: str = "rate",
) -> dict[str, Any]:
    """Filter one new pod after another and bind each in the background, as kube-scheduler does: its
    scheduling cycle (filter, prioritize) is serial, its binding cycle runs beside the next pods'. The
    caller is a process of its own (``drive``), so it does not queue for one interpreter lock with the
    fake API server. Also what it cost: the extender's CPU per filter+bind, and how busy the whole machine
    was (all cores)."""
    bodies = backend.create_all([pending_body(f"{prefix}-{i:06d}", rng) for i in range(args.rate_pods)])
    samples = [rng.sample(names, min(args.candidates, len(names))) for _ in range(64)]
    # This process is the harness now (the fake API server's objects and history, the pods to bind). Without
    # this, the collector's passes over them took a fifth of its CPU (1.1 of 5.0 s in a 12 s run at 1,000
    # nodes), CPU taken from the extender's cores.
    gc.freeze()
    here = psutil.Process()
    extender_cpu, own_cpu = sum(extender.cpu_times()[:2]), sum(here.cpu_times()[:2])
    machine = psutil.cpu_times()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        done, elapsed, binds, errors, caller_cpu = pool.apply(
            drive, (port, bodies, samples, args.seconds, args.bind_workers)
        )
    extender_cpu = sum(extender.cpu_times()[:2]) - extender_cpu
    own_cpu = sum(here.cpu_times()[:2]) - own_cpu
    after = psutil.cpu_times()
    alone: dict[str, float] = {}
    if args.filter_alone_seconds > 0:
        alone["extenderCpuMsPerFilterAlone"], alone["filtersAlone"] = filter_alone(
            port, bodies, samples, args, extender
        )
    idle = (after.idle + after.iowait) - (machine.idle + machine.iowait)
    total = sum(after) - sum(machine)
    return {
        "filterPlusBindPerSecond": round(done / elapsed, 1),
        "extenderCpuMsPerFilterPlusBind": round(1000 * extender_cpu / max(done, 1), 2),
        # the rest of the machine's work: kube-scheduler's part, and the API server's (the fake one runs in
        # this process; the real one's CPU is in machineBusyPercent only)
        "callerCpuMsPerFilterPlusBind": round(1000 * caller_cpu / max(done, 1), 2),
        "benchProcessCpuMsPerFilterPlusBind": round(1000 * own_cpu / max(done, 1), 2),
        "machineBusyPercent": round(100 * (1 - idle / total), 1) if total else 0.0,
        "sustainedBinds": binds,
        "sustainedBindErrors": errors,
        "bindWorkers": args.bind_workers,
        **alone,
    }


def filter_alone(
    port: int,
    bodies: list[dict[str, Any]],
    samples: list[list[str]],
    args: argparse.Namespace,
    extender: psutil.Process,
) -> tuple[float, int]:
    """The extender's CPU per filter with nothing bound meanwhile, for ``--filter-alone-seconds`` (the same
    pods' bodies again: a filter changes nothing, and reads only the pod it is sent): of what a
    filter+bind costs, the rest is the bind, the watch event that shows the pod bound, and the rooms that
    filters work out again for the nodes binds changed."""
    before = sum(extender.cpu_times()[:2])
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        done, _, binds, *_ = pool.apply(
            drive, (port, bodies, samples, args.filter_alone_seconds, args.bind_workers), {"and_bind": False}
        )
    assert binds == 0, f"filters alone made {binds} binds"
    # CPU times tick in 10 ms: a short run's figure is 0 or a multiple of 10 ms / filters, so the count
    # goes with it (docs/benchmarks.md runs it for seconds).
    return round(1000 * (sum(extender.cpu_times()[:2]) - before) / max(done, 1), 2), int(done)


def drive(
    port: int,
    bodies: list[dict[str, Any]],
    samples: list[list[str]],
    seconds: float,
    in_flight: int,
    *,
    and_bind: bool = True,
) -> tuple[int, float, int, int, float]:
    """kube-scheduler's calls for ``seconds``: filters one after another on one connection, each pod that
    passes bound in the background (with ``and_bind``), at most ``in_flight`` binds at a time. (filters,
    seconds, binds, bind errors, CPU seconds this took)."""

    # kube-scheduler, in Go, spends far less than this process would on encoding 500 names per filter; here
    # that CPU would be taken from the extender on the same cores, so each candidate list is encoded once
    candidates = [json.dumps(names) for names in samples]

    async def run() -> tuple[int, float, int, int, float]:
        url = f"http://127.0.0.1:{port}{PREFIX}"
        slots = asyncio.Semaphore(in_flight)
        binds: list[asyncio.Task[str]] = []
        async with aiohttp.ClientSession() as session:

            async def post(verb: str, data: str) -> Any:
                async with session.post(f"{url}/{verb}", data=data) as response:
                    if response.status != 200:
                        raise RuntimeError(f"{verb}: {response.status} {(await response.read())[:200]!r}")
                    return json.loads(await response.read())

            async def bind(body: dict[str, Any], node: str) -> str:
                meta = body["metadata"]
                try:
                    answer = await post(
                        "bind",
                        json.dumps(
                            {
                                "PodName": meta["name"],
                                "PodNamespace": meta["namespace"],
                                "PodUID": meta["uid"],
                                "Node": node,
                            }
                        ),
                    )
                finally:
                    slots.release()
                return str(answer.get("Error") or "")

            done = 0
            cpu = time.process_time()
            started = time.perf_counter()
            for i, body in enumerate(bodies):
                if time.perf_counter() - started > seconds:
                    break
                answer = await post(
                    "filter", f'{{"Pod":{json.dumps(body)},"NodeNames":{candidates[i % len(candidates)]}}}'
                )
                passed = answer["NodeNames"] or []
                if passed and and_bind:
                    await slots.acquire()
                    binds.append(asyncio.create_task(bind(body, passed[0])))
                done += 1
            elapsed = time.perf_counter() - started
            results = await asyncio.gather(*binds)
            cpu = time.process_time() - cpu
        return done, elapsed, len(binds), sum(1 for error in results if error), cpu

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=20000, help="running pods in the cache")
    parser.add_argument("--candidates", type=int, default=1000, help="node names per filter call")
    parser.add_argument("--requests", type=int, default=300, help="timed filter/prioritize/bind rounds")
    parser.add_argument("--seconds", type=float, default=20, help="length of the sustained filter+bind run")
    parser.add_argument("--rate-pods", type=int, default=15000, help="pods created for the sustained run")
    parser.add_argument(
        "--lead",
        type=int,
        default=0,
        help="timed rounds: each pod created this many rounds before its filter (kube-scheduler's queue); 0: "
        "right before it",
    )
    parser.add_argument("--policy", default="binpack")
    parser.add_argument("--bind-workers", type=int, default=16, help="binds in flight in the sustained run")
    parser.add_argument(
        "--filter-alone-seconds",
        type=float,
        default=5,
        help="after the sustained run, filters alone for this long (0: not)",
    )
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the extender process alone on the first CPU, everything else (the caller, the API server, this "
        "process) on the others, as on a cluster where kube-scheduler and kube-apiserver do not share the "
        "extender's cores",
    )
    parser.add_argument(
        "--apiserver",
        choices=("fake", "real"),
        default="fake",
        help="the fake API server in this process, or the real kube-apiserver and etcd of tests/e2e's local "
        "cluster (root; make k8s-testbins)",
    )
    args = parser.parse_args()
    args.extender_cpus = pin(args.pin)
    # SIGTERM (timeout, an impatient operator) unwinds like Ctrl-C, so the real API server and etcd stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(42)
    with contextlib.ExitStack() as stack:
        backend: Backend
        if args.apiserver == "real":
            cluster = LocalCluster(state=Path(tempfile.mkdtemp(prefix="gps-bench-cluster-")))
            backend = RealBackend(stack.enter_context(cluster.api_only()))
        else:
            backend = FakeBackend(stack.enter_context(FakeApiServer(history=1_000_000)))
        started = time.perf_counter()
        names = populate(backend, nodes=args.nodes, pods=args.pods, rng=rng)
        report: dict[str, Any] = {
            "nodes": args.nodes,
            "gpus": args.nodes * GPUS,
            "pods": args.pods,
            "candidates": args.candidates,
            "policy": args.policy,
            "lead": args.lead,
            "apiserver": args.apiserver,
            "extenderCpus": sorted(args.extender_cpus) if args.extender_cpus else "any",
            "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}",
            "populateSeconds": round(time.perf_counter() - started, 1),
        }
        report["inProcess"] = in_process(backend, names, args, rng)
        if not args.skip_http:
            report["http"] = over_http(backend, names, args, rng)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
