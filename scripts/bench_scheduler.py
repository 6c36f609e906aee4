#!/usr/bin/env python3
"""Pods scheduled per second by the real kube-scheduler, with the extender as deploy/ wires it and without.

What users feel of the extender is how much slower their scheduler gets. This measures it the way
kube-scheduler's own scheduler_perf does: a real API server (tests/e2e's local cluster, API only: etcd and
kube-apiserver, no controllers, no kubelets), ``--nodes`` Nodes created directly with the status a gpushared
node has (8 GPUs of 16 GiB: gpu-mem and gpu-count capacity, the inventory annotation; 96 CPUs, 110 pods),
then, per mode, ``--pods`` pending pods (1-8 GiB of gpu-mem, 100m CPU) created before kube-scheduler starts,
and the time from the first pod bound to the last, seen through a watch. Modes, each with a fresh
kube-scheduler (and extender) and the previous mode's pods deleted, in one run on the same machine:

- ``without``: kube-scheduler with no extender; gpu-mem is then a plain extended resource it counts itself;
- ``with``: the extender wired as deploy/control-plane/scheduler-config*.yaml ships it (filter and bind over HTTPS with
  mutual TLS, ``nodeCacheCapable``; the extender's filter keeps only the nodes its policy ranks best), the
  extender started as tests/e2e starts it;
- ``prioritize``: the same choice the way it was shipped before: ``prioritizeVerb`` with weight 100, and the
  extender started with ``--no-rank-in-filter`` (its filter passes every node that fits);
- ``no-prioritize``: no ranking by the extender at all (``--no-rank-in-filter``, no ``prioritizeVerb``):
  kube-scheduler's in-tree scores pick among the nodes that fit, which spreads; for comparison only;
- ``pct-<N>``: the shipped wiring with ``percentageOfNodesToScore: N``;
- ``no-gpu-scoring``: the shipped wiring with its opt-in second entry (``prioritize-no-gpu`` for every pod);
- ``plain-http``: the shipped wiring on plain HTTP (no TLS on the extender, ``enableHTTPS: false``): what
  TLS costs kube-scheduler; never a way to run it (anyone who reaches the port could bind pods);
- ``http1``: the shipped wiring with kube-scheduler kept to HTTP/1.1 (client-go's ``DISABLE_HTTP2``): what
  HTTP/2 saves, the same extender code answering.

Both schedulers get scheduler_perf's client settings (QPS and burst 5,000, ``--qps``): at 1.20's default (50)
the scheduler's own API calls, one Binding and one Event per pod, cap it near 25-50 pods/s and the
comparison would measure the rate limiter (with the extender, the extender posts the Binding).

With ``--pin`` the extender gets a core of its own and everything else (kube-scheduler, kube-apiserver,
etcd, this process) shares the others, in every mode: the extender as a Deployment with its own CPU request,
on a cluster whose control plane it does not share. Without it, everything shares the machine's cores, and
what the extender adds is mostly CPU the others then lack.

Where the time goes comes from the processes themselves: kube-scheduler's metrics (scheduling algorithm,
framework extension points, binding), the extender's per-verb histogram, the API server's request durations
per verb and resource (over the mode), and each process's CPU seconds (psutil).

    sudo .venv/bin/python scripts/bench_scheduler.py --nodes 1000 5000 --pods 1000
    sudo .venv/bin/python scripts/bench_scheduler.py --nodes 1000 --pods 1000 --modes without with no-prioritize pct-10

Root: the local cluster's API server runs from /var/cache/gpushared (``make k8s-testbins``). Writes the
report as JSON to stdout and, with ``--out``, to that file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import urllib3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchkit.measure import pin
from benchkit.scheduler_figures import apiserver_time, families, scheduler_breakdown, summed, throughput

from gpushared import contract
from tests.builders import inventory, pod
from tests.e2e.cluster import LocalCluster, wait_for

GPUS, GPU_GIB = 8, 16


#: Concurrent requests while creating and deleting objects.
CREATORS = 16


#: What a mode adds to the extender's command line.
EXTENDER_ARGS = {"prioritize": ["--no-rank-in-filter"], "no-prioritize": ["--no-rank-in-filter"]}


#: The modes there are, beside ``pct-<N>``.
MODES = ("without", "with", "prioritize", "no-prioritize", "no-gpu-scoring", "plain-http", "http1")


MERGE = {"Content-Type": "application/merge-patch+json"}


#: The processes whose CPU is counted, by the name LocalCluster spawns them under.
PROCESSES = ("kube-scheduler", "gpushared-extender", "kube-apiserver", "etcd")


UNTAINT = {"spec": {"taints": None}}


def node_body(name: str) -> dict[str, Any]:
    """A Node as a gpushared node's kubelet and daemon leave it, Ready, with room for far more than the run."""
    inv = inventory(*[GPU_GIB] * GPUS)
    capacity = {
        "cpu": "96",
        "memory": "768Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        contract.DEFAULT_RESOURCES.gpu_mem: str(inv.total),
        contract.DEFAULT_RESOURCES.gpu_count: str(GPUS),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": "Tesla-V100-SXM2-16GB"},
            "annotations": {contract.NODE_INVENTORY: contract.format_inventory(inv)},
        },
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
        },
    }


def pod_body(name: str, mode: str, rng: random.Random) -> dict[str, Any]:
    body = pod(name, rng.randint(1, 8), uid=None, cpu="100m")
    del body["metadata"]["uid"]  # the API server's to give
    body["metadata"]["labels"] = {"bench": mode}
    body["spec"]["automountServiceAccountToken"] = False
    body.pop("status", None)
    return body


class Api:
    """Just what the benchmark asks of the API server, as the cluster's admin, on a pooled connection."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.server = cluster.server
        self.http = urllib3.PoolManager(maxsize=CREATORS, ca_certs=str(cluster.state / "pki" / "ca.crt"))
        self.headers = {"Authorization": f"Bearer {cluster.tokens['admin']}", "Content-Type": "application/json"}

    def request(
        self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None, **kw: Any
    ) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {**self.headers, **(headers or {})}
        answer = self.http.request(method, self.server + path, body=data, headers=headers, **kw)
        if answer.status >= 300:
            raise RuntimeError(f"{method} {path}: {answer.status} {answer.data[:300]!r}")
        return answer

    def json(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        return json.loads(self.request(method, path, body).data)  # type: ignore[no-any-return]

    def each(self, call: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        with ThreadPoolExecutor(CREATORS) as pool:
            return list(pool.map(call, items))

    def metrics(self) -> str:
        return str(self.request("GET", "/metrics").data.decode())


class Bound:
    """When each pod of a mode was first seen bound, from one watch opened before the scheduler starts."""

    def __init__(self, api: Api, mode: str, resource_version: str) -> None:
        self.times: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(api, mode, resource_version), daemon=True)
        self._thread.start()

    def _watch(self, api: Api, mode: str, resource_version: str) -> None:
        path = (
            f"/api/v1/namespaces/default/pods?watch=1&labelSelector=bench%3D{mode}"
            f"&resourceVersion={resource_version}&allowWatchBookmarks=false"
        )
        answer = api.request("GET", path, preload_content=False, timeout=urllib3.Timeout(connect=5, read=None))
        buffer = b""
        for chunk in answer.stream(65536):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            now = time.monotonic()
            for line in lines:
                event = json.loads(line)
                body = event["object"]
                if event["type"] in ("ADDED", "MODIFIED") and body["spec"].get("nodeName"):
                    self.times.setdefault(body["metadata"]["name"], now)
            if self._stop.is_set():
                break

    def stop(self) -> None:
        self._stop.set()


def cpu_seconds(cluster: LocalCluster) -> dict[str, float]:
    found = {}
    for name in PROCESSES:
        process = cluster.process(name)
        if process is not None:
            times = process.cpu_times()
            found[name] = times.user + times.system
    return found


def adjust_for(mode: str, qps: int) -> tuple[bool, Callable[[dict[str, Any]], None]]:
    """Whether the mode wires the extender, and what it changes in the KubeSchedulerConfiguration (and
    :data:`EXTENDER_ARGS`, on the extender's command line)."""

    def adjust(config: dict[str, Any]) -> None:
        config["clientConnection"].update(qps=qps, burst=qps)
        if mode != "no-gpu-scoring":  # the shipped files leave that second entry commented out
            extenders = config.get("extenders", [])
            extenders[:] = [e for e in extenders if e.get("prioritizeVerb") != "prioritize-no-gpu"]
        if mode == "prioritize":  # the first entry, the one with filterVerb, also scores
            for extender in config.get("extenders", []):
                if extender.get("filterVerb"):
                    extender.update(prioritizeVerb="prioritize", weight=100)
        if mode.startswith("pct-"):
            config["percentageOfNodesToScore"] = int(mode.removeprefix("pct-"))

    if mode not in MODES and not mode.startswith("pct-"):
        raise SystemExit(f"unknown mode {mode!r}; one of {', '.join(MODES)} or pct-<N>")
    return mode != "without", adjust


def run_mode(
    cluster: LocalCluster, api: Api, mode: str, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    uses_extender, adjust = adjust_for(mode, args.qps)
    label = mode.replace("-", "")
    if uses_extender:
        cluster.scheduling.restart_extender(*EXTENDER_ARGS.get(mode, []), plain=mode == "plain-http")
        if args.extender_cpus:
            pin_process(cluster, "gpushared-extender", args.extender_cpus)
    bodies = [pod_body(f"{label}-{i:05d}", label, rng) for i in range(args.pods)]
    listed = api.json("GET", "/api/v1/namespaces/default/pods?limit=1")
    bound = Bound(api, label, listed["metadata"]["resourceVersion"])
    api.each(lambda body: api.json("POST", "/api/v1/namespaces/default/pods", body), bodies)
    time.sleep(2 if uses_extender else 0)  # the extender's watch has every pending pod before the first filter
    api_before = api.metrics()
    cpu_before = cpu_seconds(cluster)
    started = time.monotonic()
    cluster.scheduling.restart_scheduler(
        extenders=uses_extender, adjust=adjust, env={"DISABLE_HTTP2": "1"} if mode == "http1" else None
    )
    profiling = profile(cluster, bound, args, mode, uses_extender=uses_extender) if args.profile else None
    try:
        wait_for(lambda: len(bound.times) >= args.pods, timeout=args.timeout, what=f"{args.pods} pods bound ({mode})")
    except Exception as exc:  # a mode that stalls is a result, not the end of the run
        error: str | None = str(exc)
    else:
        error = None
    cpu_after = cpu_seconds(cluster)
    if profiling is not None:
        profiling.join()
    report: dict[str, Any] = {"mode": mode, **throughput(list(bound.times.values()))}
    if bound.times:
        report["startToFirstBindSeconds"] = round(min(bound.times.values()) - started, 2)
    if error:
        report["error"] = error
        events = api.json("GET", "/api/v1/namespaces/default/events?fieldSelector=reason%3DFailedScheduling&limit=1")
        report["lastFailedScheduling"] = [e.get("message") for e in events["items"]]
    report["cpuSeconds"] = {
        name: round(cpu_after[name] - cpu_before.get(name, 0.0), 2) for name in PROCESSES if name in cpu_after
    }
    report["scheduler"] = scheduler_breakdown(cluster.scheduling.scheduler_metrics())
    if uses_extender:
        samples = families(cluster.scheduling.extender_metrics())
        report["extender"] = summed(samples, "gpushared_extender_request_seconds", by="verb")
        # new connections kube-scheduler opened (a TLS handshake each), the benchmark's readiness probes aside
        opened = {
            dict(labels).get("protocol", ""): int(value)
            for (name, labels), value in samples.items()
            if name == "gpushared_extender_connections_total"
        }
        report["extenderConnections"] = sum(opened.values())
        report["extenderConnectionsByProtocol"] = opened  # h2: kube-scheduler's calls share one connection
    report["apiserver"] = apiserver_time(api_before, api.metrics())
    bound.stop()
    cluster.stop("kube-scheduler")
    cluster.stop("gpushared-extender")
    clear_pods(api, label)
    return report


def profile(
    cluster: LocalCluster, bound: Bound, args: argparse.Namespace, mode: str, *, uses_extender: bool, seconds: int = 4
) -> threading.Thread:
    """CPU profiles of ``seconds`` of steady binding, from the time a fifth of the pods are bound (start-up
    and the informers' lists left out): kube-scheduler's own (Go's pprof, from its debugging server,
    ``scheduler_get``; ``go tool pprof -top`` reads it) and, with the extender, py-spy's of the extender (``pip install
    py-spy``; collapsed stacks). The thread ends with both files written."""
    prefix = args.profile / f"{args.nodes_now}-{mode}"

    def go() -> None:
        wait_for(lambda: len(bound.times) >= args.pods // 5, timeout=args.timeout, what="a fifth of the pods bound")
        spy = None
        extender = cluster.process("gpushared-extender") if uses_extender else None
        if extender is not None and shutil.which("py-spy"):  # without py-spy, kube-scheduler's profile alone
            spy = subprocess.Popen(
                ["py-spy", "record", "--pid", str(extender.pid), "--duration", str(seconds + 1), "--rate", "200",
                 "--gil", "--format", "raw", "--output", f"{prefix}-extender.txt", "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        for _ in range(50):  # until the scheduler serves
            with contextlib.suppress(OSError):
                page = cluster.scheduling.scheduler_get(f"/debug/pprof/profile?seconds={seconds}", timeout=seconds + 10)
                Path(f"{prefix}-scheduler.pprof").write_bytes(page)
                break
            time.sleep(0.1)
        if spy is not None:
            spy.wait()

    prefix.parent.mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def clear_pods(api: Api, label: str) -> None:
    """Every pod of the mode gone at once (grace 0: no kubelet would ever confirm a graceful deletion)."""
    api.request("DELETE", f"/api/v1/namespaces/default/pods?labelSelector=bench%3D{label}&gracePeriodSeconds=0")
    wait_for(
        lambda: not api.json("GET", f"/api/v1/namespaces/default/pods?labelSelector=bench%3D{label}")["items"],
        timeout=120,
        what=f"the {label} pods deleted",
    )


def pin_process(cluster: LocalCluster, name: str, cpus: set[int]) -> None:
    """Every thread of the named process onto ``cpus`` (threads it starts later inherit it)."""
    process = cluster.process(name)
    for thread in process.threads() if process is not None else []:
        os.sched_setaffinity(thread.id, cpus)


@contextlib.contextmanager
def cluster_of(nodes: int) -> Iterator[tuple[LocalCluster, Api]]:
    cluster = LocalCluster(state=Path(tempfile.mkdtemp(prefix="gps-bench-scheduler-")))
    with cluster.api_only():
        api = Api(cluster)
        # Pod admission wants the namespace's default ServiceAccount, which no controller creates here.
        api.json("POST", "/api/v1/namespaces/default/serviceaccounts", {"metadata": {"name": "default"}})
        api.each(lambda i: api.json("POST", "/api/v1/nodes", node_body(f"node-{i:05d}")), list(range(nodes)))
        # The TaintNodesByCondition admission plugin taints every new Node not-ready; with no node lifecycle
        # controller here to see it Ready, the taint is lifted as that controller would.
        api.each(lambda i: api.request("PATCH", f"/api/v1/nodes/node-{i:05d}", UNTAINT, headers=MERGE), range(nodes))
        try:
            yield cluster, api
        finally:
            cluster.stop("kube-scheduler")
            cluster.stop("gpushared-extender")


#: What the table shows where a mode has no figure (an en dash, as docs/benchmarks.md's tables have it).
NONE = "\u2013"


def add_ratios(run: dict[str, Any]) -> None:
    """Each mode's pods/s against the mean of the run's ``without`` modes: the machine drifts by 10-20 %
    within minutes, and modes run between ``without`` runs are held against what bracketed them; each
    ``without`` gets its own ratio too, which is that drift."""
    bases = [m["podsPerSecond"] for m in run["modes"] if m["mode"] == "without" and m.get("podsPerSecond")]
    if bases:
        base = statistics.fmean(bases)
        run["withoutPodsPerSecond"] = round(base, 1)
        for m in run["modes"]:
            if m.get("podsPerSecond"):
                m["ratio"] = round(m["podsPerSecond"] / base, 3)


def table(report: dict[str, Any]) -> str:
    """docs/benchmarks.md's table of a report: per node count and mode, pods/s, the ratio to the first
    ``without``, the per-second spread, the serial part per pod, the extender's verbs (server side), the
    connections kube-scheduler opened to it per 1,000 pods, and each process's CPU per pod."""
    lines = [
        "| nodes | mode | pods/s | ratio | per-second p50 (min-max) | algorithm ms/pod | extender filter / "
        "prioritize / bind ms | connections per 1,000 pods | CPU ms/pod: scheduler / extender / apiserver / etcd |",
        "|---:|---|---:|---:|---|---:|---|---:|---|",
    ]
    pods = report["pods"]
    for run in report["runs"]:
        for m in run["modes"]:
            if not m.get("podsPerSecond"):
                lines.append(f"| {run['nodes']:,} | {m['mode']} | {m.get('error', 'no pods bound')} |")
                continue
            spread = m["perSecond"]
            algorithm = m["scheduler"]["scheduling_algorithm_duration"].get("", {}).get("meanMs")
            verbs = m.get("extender", {})
            ext = " / ".join(
                f"{verbs[v]['meanMs']:.2f}" if verbs.get(v, {}).get("meanMs") is not None else NONE
                for v in ("filter", "prioritize", "bind")
            ) if verbs else NONE  # fmt: skip
            connections = m.get("extenderConnections")
            churn = NONE if connections is None else f"{1000 * connections / pods:.0f}"
            cpu = " / ".join(
                f"{1000 * m['cpuSeconds'][name] / pods:.2f}" if name in m["cpuSeconds"] else NONE for name in PROCESSES
            )
            lines.append(
                f"| {run['nodes']:,} | {m['mode']} | {m['podsPerSecond']} | {m.get('ratio', '')} | "
                f"{spread['p50']} ({spread['min']}-{spread['max']}) | {algorithm:.2f} | {ext} | {churn} | {cpu} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--pods", type=int, default=1000, help="pods scheduled per mode")
    parser.add_argument("--modes", nargs="+", default=["without", "with"])
    parser.add_argument("--qps", type=int, default=5000, help="kube-scheduler's client QPS and burst")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a mode may take to bind every pod")
    parser.add_argument(
        "--pin", action="store_true", help="the extender alone on the first CPU, the rest on the others"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, help="only print docs/benchmarks.md's table of this report")
    parser.add_argument(
        "--profile", type=Path, help="write CPU profiles of kube-scheduler (pprof) and the extender (py-spy) here"
    )
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    args.extender_cpus = pin(args.pin)
    for mode in args.modes:
        adjust_for(mode, args.qps)  # an unknown mode fails before any cluster starts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C: the API server stops too
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}",
        "pods": args.pods,
        "qps": args.qps,
        "extenderCpus": sorted(args.extender_cpus) if args.extender_cpus else "shared",
        "runs": [],
    }
    for nodes in args.nodes:
        args.nodes_now = nodes
        with cluster_of(nodes) as (cluster, api):
            report["kubernetes"] = str(cluster.version("kube-scheduler"))
            run: dict[str, Any] = {"nodes": nodes, "modes": []}
            for mode in args.modes:
                rng = random.Random(42)  # the same pods in every mode
                run["modes"].append(run_mode(cluster, api, mode, args, rng))
                print(json.dumps(run["modes"][-1]), file=sys.stderr)
            add_ratios(run)
            report["runs"].append(run)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
