#!/usr/bin/env python3
"""The claim allocator through a real kube-scheduler (Kubernetes >= 1.34, DRA): pods per second, and each pod's
latency from its creation to its binding (``spec.nodeName`` set), p50, p99 and max, gated through the claim
allocator against kube-scheduler allocating the claims itself.

scripts/bench_claims.py measures the allocator alone against the fake API server; this runs the whole path
on tests/e2e's local cluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, one kubelet, the
gpushared daemon and extender, all real; only the GPUs simulated). Modes, each with every size given:

- ``ungated``: no webhook, no allocator: kube-scheduler allocates each claim itself (its DRA plugin: the
  first device of the chosen node with room);
- ``gated``: deploy/dra/claim-allocator.yaml applied (its webhook called at the extender's URL, as
  tests/e2e/test_dra_allocator.py's fixture wires it), the extender run with ``--claim-allocator --policy
  POLICY``: the webhook gates each pod, the extender's leader allocates its claim and removes the gate, and
  kube-scheduler binds the pod to the allocation's node.

kube-scheduler runs stock in both (no extender entries: the allocator needs none, and the harness's opt-in
``prioritize-no-gpu`` entry would cost every pod an extender call), with client QPS and burst ``--qps``.

The nodes: one kubelet is not enough for 100, so ``--nodes`` simulated DRA nodes of ``--gpus`` GPUs of
``--gib`` GiB are added (benchkit/claims_cluster.py: a Node with the inventory annotation, a ResourceSlice
and a Lease each, the Lease renewed and the Ready condition posted so the node lifecycle controller never
taints them). Pods bound there never run (no kubelet): what is measured there is scheduling, created to
bound. Each run creates ``--pods`` pods, each with its own claim of 1-8 GiB of gpushared's DeviceClass, at
``--rates`` per second (0: all at once), in a namespace of its own, deleted after it (its pods at once,
grace 0). While they run the real node publishes no slice (its daemon in device-plugin mode).

Then the one real node, its daemon in DRA mode (16, 12, 24 and 8 GiB GPUs), the simulated nodes gone:
``--real-pods`` pods with claims of 1-2 GiB at ``--real-rate`` per second in each mode, and each pod's latency
from its creation to running (phase Running: the kubelet prepared the claim through the daemon and started
the container).

Bounded: each run waits at most ``--run-timeout`` seconds after its last pod is created (and stops sooner
when ``--stall`` seconds pass with no pod bound), a run that would not end within ``--budget`` seconds of the
start is skipped and says so, every API call has a timeout; what it created (nodes, slices, Leases,
namespaces, the allocator's objects) is deleted and the cluster brought down on every way out.

    sudo flock /var/lock/gpushared-cluster.lock env GPUSHARED_K8S_CACHE=/var/cache/gpushared/k8s-1.36.2 \\
        .venv/bin/python scripts/bench_claims_cluster.py --nodes 100 --pods 500 --rates 20 0 \\
        --out bench/results/claims-cluster-500-v1.36.2.json

Root (the local cluster). Writes the report as JSON to stdout and, with ``--out``, to that file; the Kubernetes
version is the API server's own /version, and the git commit the code ran on is recorded.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchkit.claims_cluster import (
    Api,
    Creation,
    PodWatch,
    SimulatedNodes,
    namespace,
    over_capacity,
    remove_namespace,
    wait_done,
)
from benchkit.measure import percentiles
from benchkit.scheduler_figures import families, throughput

from tests.e2e.cluster import NODE, LocalCluster, cached_version, wait_for
from tests.e2e.versions import serves_dra

ROOT = Path(__file__).resolve().parent.parent
DRA = ROOT / "deploy" / "dra"
#: The processes whose CPU is counted, by the name LocalCluster spawns them under.
PROCESSES = (
    "kube-scheduler", "gpushared-extender", "kube-apiserver", "etcd", "kube-controller-manager",
    "kubelet", "containerd", "gpushared",
)  # fmt: skip
#: Pods scheduled after each mode change, not measured: the extender's informers, its Lease and the webhook in
#: place, kube-scheduler's caches warm.
WARM_PODS = 10
#: The claims' sizes, GiB: on the simulated nodes, and on the real node (16 + 12 + 24 + 8 GiB: 1-2 GiB claims
#: fit whatever order they come in, first fit or not).
SIZES, REAL_SIZES = (1, 8), (1, 2)


def allocator_objects(cluster: LocalCluster) -> str:
    """deploy/dra/claim-allocator.yaml, its webhook called at the extender's URL with the extender's CA."""
    docs = [d for d in yaml.safe_load_all((DRA / "claim-allocator.yaml").read_text()) if d]
    ca = base64.b64encode((cluster.scheduling.extender_certs / "ca.crt").read_bytes()).decode()
    for doc in docs:
        for webhook in doc.get("webhooks", []):
            client = webhook["clientConfig"]
            client["url"] = cluster.scheduling.extender_url + client.pop("service")["path"]
            client["caBundle"] = ca
    return yaml.safe_dump_all(docs)


def dra_objects(cluster: LocalCluster) -> None:
    """The DeviceClass, the driver's RBAC and admission policy, the real node's own identity bound to them:
    what tests/e2e/test_dra.py's ``dra_node`` applies."""
    for name in ("deviceclass.yaml", "driver-rbac.yaml", "admission-policy.yaml"):
        cluster.kubectl("apply", "-f", DRA / name)
    for role in ("gpushared-node", "gpushared-dra-driver"):
        cluster.kubectl(
            "create", "clusterrolebinding", f"gpushared-node-{NODE}-{role}", f"--clusterrole={role}",
            f"--serviceaccount=kube-system:gpushared-node-{NODE}",
        )  # fmt: skip


def set_mode(cluster: LocalCluster, api: Api, mode: str, policy: str) -> None:
    """The webhook and the allocator in place (``gated``) or gone (``ungated``), the extender restarted and
    leading again."""
    objects = allocator_objects(cluster)
    if mode == "gated":
        cluster.kubectl("apply", "-f", "-", input=objects)
        cluster.scheduling.restart_extender("--claim-allocator", "--policy", policy)
    else:
        cluster.kubectl("delete", "--ignore-not-found", "-f", "-", input=objects)
        cluster.scheduling.restart_extender()
    process = cluster.process("gpushared-extender")
    pid = process.pid if process is not None else -1

    def leading() -> bool:
        lease = api.json("GET", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/gpushared-extender")
        holder = str(lease["spec"].get("holderIdentity", "")).split(" ")[0]  # "<host>-<pid> <url>"
        return holder.endswith(f"-{pid}")

    wait_for(leading, timeout=60, what="the extender leading", interval=0.5)


def counters(cluster: LocalCluster) -> dict[str, float]:
    """The extender's claim outcomes and fence holds, kube-scheduler's attempts by result, each process's CPU."""
    found: dict[str, float] = defaultdict(float)
    pages = {"extender": cluster.scheduling.extender_metrics(), "scheduler": cluster.scheduling.scheduler_metrics()}
    for page in pages.values():
        for (name, labels), value in families(page).items():
            label = dict(labels)
            if name == "gpushared_extender_claim_pods_total":
                found[f"claimPods.{label.get('outcome')}"] += value
            elif name == "gpushared_extender_claim_fence_holds_total":
                found["fenceHolds"] += value
            elif name == "scheduler_schedule_attempts_total":
                found[f"schedulerAttempts.{label.get('result')}"] += value
    for name in PROCESSES:
        process = cluster.process(name)
        if process is not None:
            times = process.cpu_times()
            found[f"cpuSeconds.{name}"] = times.user + times.system
    own = psutil.Process().cpu_times()
    found["cpuSeconds.benchmark"] = own.user + own.system
    machine = psutil.cpu_times()
    found["machineBusySeconds"] = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    return found


def run(
    cluster: LocalCluster, api: Api, *, mode: str, pods: int, rate: float, label: str, real: bool, args: Any
) -> dict[str, Any]:
    """One run: its namespace, its pods created, watched until bound (running, on the real node), figured,
    and deleted."""
    ns = f"bench-{label}"
    rng = random.Random(args.seed)  # the same claims in both modes
    low, high = REAL_SIZES if real else SIZES
    sizes = [rng.randint(low, high) for _ in range(pods)]
    namespace(api, ns)
    watch = PodWatch(api, ns)
    before, load = counters(cluster), os.getloadavg()[0]
    try:
        creation = Creation(api, ns, sizes, rate)
        done = watch.running if real else watch.bound
        error = wait_done(done, len(creation.sent), timeout=args.run_timeout, stall=args.stall)
        after = counters(cluster)
        sent = creation.sent
        report: dict[str, Any] = {
            "mode": mode, "node": "real" if real else "simulated", "pods": pods, "rate": rate,
            "claimGiB": [low, high], "created": len(sent), "createSeconds": round(creation.seconds, 2),
            "bound": len(watch.bound), "loadBefore": round(load, 2),
        }  # fmt: skip
        if watch.bound:
            span = max(watch.bound.values()) - min(sent.values())
            report["seconds"] = round(span, 2)
            report["podsPerSecond"] = round(len(watch.bound) / span, 1) if span else None
            report["bindWindow"] = throughput(list(watch.bound.values()))
        report["createdToBound"] = latencies(sent, watch.bound)
        if mode == "gated":
            report["createdToUngated"] = latencies(sent, watch.ungated)
            report["ungatedToBound"] = latencies(watch.ungated, watch.bound)
        if real:
            report["createdToRunning"] = latencies(sent, watch.running)
        report["admission"] = percentiles(creation.admission) if creation.admission else {}
        report["counts"] = {
            key: round(after[key] - before.get(key, 0.0), 2)
            for key in sorted(after)
            if after[key] - before.get(key, 0.0)
        }
        counts = report["counts"]
        ours = sum(v for k, v in counts.items() if k.startswith("cpuSeconds."))
        report["otherCpuSeconds"] = round(counts.pop("machineBusySeconds", 0.0) - ours, 2)  # others' work here
        report["schedulerErrors"] = scheduler_errors(cluster, ns)
        report["overCapacity"] = over_capacity(api, ns)
        for problem, value in (("error", error), ("createErrors", creation.errors[:5]), ("watchErrors", watch.errors)):
            if value:
                report[problem] = value
        return report
    finally:
        watch.stop()
        remove_namespace(api, cluster, ns, real=real)


def scheduler_errors(cluster: LocalCluster, ns: str) -> dict[str, int]:
    """kube-scheduler's failed attempts for the run's pods, counted by its error (the claim's name left out)."""
    found: dict[str, int] = defaultdict(int)
    with (cluster.logs / "kube-scheduler.log").open(errors="replace") as log:
        for line in log:
            if "Error scheduling pod" in line and f'pod="{ns}/' in line:
                error = re.search(r'err="((?:[^"\\]|\\.)*)"', line)
                text = error.group(1).replace('\\"', '"') if error else line.strip()
                found[re.sub(rf"{ns}/p\d+", "<claim>", text)] += 1
    return dict(found)


def latencies(sent: dict[str, float], reached: dict[str, float]) -> dict[str, float]:
    samples = [reached[name] - sent[name] for name in sent if name in reached]
    return percentiles(samples) if samples else {}


def warm(cluster: LocalCluster, api: Api, mode: str, args: Any, *, real: bool) -> dict[str, Any]:
    """A few pods through the mode before it is measured; in ``gated`` they must have been allocated by the
    allocator (the webhook and the leader in place), else the mode would measure something else."""
    report = run(cluster, api, mode=mode, pods=WARM_PODS, rate=0, label=f"warm-{mode}", real=real, args=args)
    allocated = report["counts"].get("claimPods.allocated", 0)
    if report.get("error") or (mode == "gated" and allocated < WARM_PODS):
        raise RuntimeError(f"the {mode} mode does not work: {json.dumps(report)}")
    return report


def real_node_dra(cluster: LocalCluster, api: Api) -> None:
    """The real node's daemon in DRA mode, its slice published."""
    cluster.node.restart_daemon(dra=True)
    cluster.node.wait_serving()

    def published() -> bool:
        slices = api.json("GET", "/apis/resource.k8s.io/v1/resourceslices")["items"]
        return any(s["spec"].get("nodeName") == NODE for s in slices)

    wait_for(published, timeout=60, what="the real node's ResourceSlice", interval=0.5)


def source() -> dict[str, Any]:
    """The commit this tree is at and what in gpushared/ differs from it (others' uncommitted work included)."""

    def git(*argv: str) -> str:
        out = subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.rstrip("\n")

    dirty = git("status", "--porcelain", "--", "gpushared", "deploy").splitlines()
    return {"commit": git("rev-parse", "HEAD"), "tree": str(ROOT), "uncommitted": dirty}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100, help="simulated DRA nodes")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per simulated node")
    parser.add_argument("--gib", type=int, default=16, help="GiB per simulated GPU")
    parser.add_argument("--pods", type=int, nargs="+", default=[500], help="pods per run (each size a run)")
    parser.add_argument("--rates", type=float, nargs="+", default=[20, 0], help="pods created per second (0: at once)")
    parser.add_argument("--modes", nargs="+", choices=["ungated", "gated"], default=["ungated", "gated"])
    parser.add_argument("--real-pods", type=int, default=16, help="pods on the real node per mode (0: none)")
    parser.add_argument("--real-rate", type=float, default=2)
    parser.add_argument("--policy", default="fgd", help="the allocator's policy (the extender's default: fgd)")
    parser.add_argument("--qps", type=int, default=5000, help="kube-scheduler's client QPS and burst")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--run-timeout", type=float, default=240, help="seconds a run may wait after its last pod")
    parser.add_argument("--stall", type=float, default=60, help="a run ends when no pod is bound for this long")
    parser.add_argument("--budget", type=float, default=780, help="seconds the whole benchmark may take")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, nargs="+", help="only print docs/benchmarks.md's table of these reports")
    return parser.parse_args()


def header(args: argparse.Namespace) -> dict[str, Any]:
    cache = os.environ.get("GPUSHARED_K8S_CACHE", "")
    return {
        "benchmark": "claims-cluster",
        "command": shlex.join([f"GPUSHARED_K8S_CACHE={cache}", os.path.relpath(sys.executable), *sys.argv]),
        "source": source(),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}",
        "policy": args.policy, "qps": args.qps, "scheduler": "stock: no extender entries",
        "simulatedNodes": {"count": args.nodes, "gpus": args.gpus, "gib": args.gib},
        "realNode": {"name": NODE, "gpusMiB": [16384, 12288, 24576, 8192]},
        "runs": [], "skipped": [],
    }  # fmt: skip


def table(paths: list[Path]) -> str:
    """docs/benchmarks.md's table of reports: per run, pods/s, created to bound (and to running, on the real
    node), the allocator's share (created to ungated), kube-scheduler's failed attempts, others' CPU."""
    lines = [
        "| nodes | mode | pods | created | pods/s | created \u2192 bound p50 / p99 / max "
        "| created \u2192 ungated p50 / p99 | created \u2192 running p50 / p99 / max | kube-scheduler retries "
        "| other work, CPU s |",
        "|---|---|---:|---|---:|---|---|---|---:|---:|",
    ]

    def ms(figures: dict[str, float], *keys: str) -> str:
        return " / ".join(f"{figures[k] / 1000:.2f} s" if figures[k] >= 1000 else f"{figures[k]:.0f} ms" for k in keys)

    for path in paths:
        report = json.loads(path.read_text())
        for r in report["runs"]:
            where = "1 real" if r["node"] == "real" else f"{report['simulatedNodes']['count']} simulated"
            ungated = ms(r["createdToUngated"], "p50_ms", "p99_ms") if r.get("createdToUngated") else "\u2013"
            running = ms(r["createdToRunning"], "p50_ms", "p99_ms", "max_ms") if r.get("createdToRunning") else "\u2013"
            rate = f"{r['rate']:g}/s" if r["rate"] else "at once"
            lines.append(
                f"| {where} | {r['mode']} | {r['pods']} | {rate} "
                f"| {r.get('podsPerSecond')} | {ms(r['createdToBound'], 'p50_ms', 'p99_ms', 'max_ms')} | {ungated} "
                f"| {running} | {r['counts'].get('schedulerAttempts.error', 0):g} | {r.get('otherCpuSeconds', '')} |"
            )
    return "\n".join(lines)


def leftovers(cluster: LocalCluster, *, since: float) -> list[str]:
    """What the cluster left running, as the e2e session checks it, but only processes started since ``since``
    and not waiting for the cluster's lock (another engineer's command naming the cluster's directory)."""
    found = []
    for line in cluster.leftovers():
        pid = line.split(" ", 1)[0]
        if "gpushared-cluster.lock" in line:
            continue
        try:
            if pid.isdigit() and psutil.Process(int(pid)).create_time() < since:
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(line)
    return found


def main() -> None:
    args = arguments()
    if args.table:
        print(table(args.table))
        return
    started, wall = time.monotonic(), time.time()
    # The cluster's Python processes (the extender, the daemon) import the same tree as this script.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    version = cached_version("kube-apiserver")
    if version is None or not serves_dra(version):
        raise SystemExit(f"DRA needs Kubernetes >= 1.34; GPUSHARED_K8S_CACHE holds {version}")
    if os.geteuid() != 0:
        raise SystemExit("the local cluster needs root")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C: the cluster comes down too
    report = header(args)
    cluster = LocalCluster()
    try:
        cluster.up()
        on_cluster(cluster, report, args, started)
    except BaseException as error:
        report["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        cluster.down()
        report["leftovers"] = leftovers(cluster, since=wall)
        report["seconds"] = round(time.monotonic() - started, 1)
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")


def on_cluster(cluster: LocalCluster, report: dict[str, Any], args: argparse.Namespace, started: float) -> None:
    """The runs on the simulated nodes, then on the real node; the simulated nodes deleted whatever happens."""
    api = Api(cluster)
    info = api.json("GET", "/version")
    report["kubernetes"] = info["gitVersion"]
    report["binaries"] = {b: str(cluster.version(b)) for b in ("kube-scheduler", "kube-controller-manager", "kubelet")}
    grace = controller_grace(cluster)
    report["nodeMonitorGracePeriodSeconds"] = grace

    def adjust(config: dict[str, Any]) -> None:
        config["clientConnection"].update(qps=args.qps, burst=args.qps)

    cluster.scheduling.restart_scheduler(extenders=False, adjust=adjust)
    dra_objects(cluster)
    nodes = SimulatedNodes(
        api, count=args.nodes, gpus=args.gpus, gib=args.gib, grace=grace, kubelet_version=info["gitVersion"]
    )
    try:
        nodes.create()
        report["heartbeat"] = {"leaseEverySeconds": nodes.renew_every, "readyEverySeconds": nodes.status_every}
        measure(cluster, api, report, args, started, nodes=nodes)
        report["unwellAfter"] = nodes.unwell()
    finally:
        report.setdefault("heartbeat", {}).update(nodes.beats)
        nodes.delete()
    if args.real_pods:
        real_node_dra(cluster, api)
        measure(cluster, api, report, args, started, nodes=None)


def measure(
    cluster: LocalCluster, api: Api, report: dict[str, Any], args: Any, started: float, *, nodes: SimulatedNodes | None
) -> None:
    """Every mode, warmed, then each of its runs that fits the budget: on the simulated nodes every size and
    rate (``nodes`` given, each run says how many of them were unwell after it), on the real node
    ``--real-pods`` at ``--real-rate``."""
    real = nodes is None
    sizes = [(args.real_pods, args.real_rate)] if real else [(p, r) for p in args.pods for r in args.rates]
    for mode in args.modes:
        set_mode(cluster, api, mode, args.policy)
        warm(cluster, api, mode, args, real=real)
        for pods, rate in sizes:
            expected = (pods / rate if rate else pods / 10) + 60  # at 10 pods/s a burst would still end
            label = f"{mode}-{'real' if real else 'sim'}-{pods}-{rate:g}".replace(".", "-")
            if time.monotonic() - started + expected > args.budget:
                report["skipped"].append(f"{label}: would pass the {args.budget:.0f} s budget")
                continue
            result = run(cluster, api, mode=mode, pods=pods, rate=rate, label=label, real=real, args=args)
            if nodes is not None:
                result["unwellNodes"] = len(nodes.unwell())
            report["runs"].append(result)
            print(json.dumps(result), file=sys.stderr)


def controller_grace(cluster: LocalCluster) -> float:
    """kube-controller-manager's ``--node-monitor-grace-period`` as it runs (1.36's default: 50 s)."""
    process = cluster.process("kube-controller-manager")
    argv = process.cmdline() if process is not None else []
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag == "--node-monitor-grace-period":
            return parse_duration(value if equals else argv[index + 1])
    return 50.0


def parse_duration(text: str) -> float:
    """A Go duration (``20s``, ``1m0s``, ``1h30m``, ``500ms``) in seconds, as the controller's flags give them."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "\u00b5s": 1e-6, "ns": 1e-9}
    parts = re.findall(r"([0-9.]+)(h|ms|us|\u00b5s|ns|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(number) * units[unit] for number, unit in parts)


if __name__ == "__main__":
    main()
