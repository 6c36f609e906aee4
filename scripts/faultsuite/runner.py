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
("hung"), its processes are killed and the next scenario runs. Then one scenario drives the node daemon and
counts from what the kubelet got, and the last the claim allocator beside a tenant whose pods kube-scheduler
never places (``faultsuite.tenant``): another tenant's pod must be allocated within 2 s.

    .venv/bin/python scripts/chaos.py [--pods 200] [--nodes 30] [--threads 8] [--only NAME ...] [--json FILE]

docs/reliability.md has the table and what each scenario does. The exit status is 1 if any count is not 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from faultsuite.counting import Outcome, count
from faultsuite.harness import Hung, World, deadline, healthz_probe, loop_lag, schedule, settle
from faultsuite.node import NodeOutcome, run_node_within
from faultsuite.scenarios import SCENARIOS
from faultsuite.scenarios.failover import WaitingAtFailover
from faultsuite.tenant import TENANT_SCENARIO, WITHIN_SECONDS, TenantOutcome, run_tenant_within
from tests.builders import pod
from tests.pki import Authority, Pair

#: The pods of a scenario ask for at least this much of the cluster's GPU memory.
OVERCOMMIT = 1.25


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
        if "containers" in runs[0] or "waits" in runs[0]:  # the node daemon's and the tenant's: below the table
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
    tenants = [r for r in records if "waits" in r]
    if tenants:
        waits = [wait for r in tenants for wait in r["waits"]]
        lines += [
            "",
            f"Claim allocator beside a tenant's unschedulable pods, {len(tenants)} runs: ordinary pods allocated "
            f"{min(waits):.2f}-{max(waits):.2f} s after creation (pass: {WITHIN_SECONDS:g} s); late "
            f"{sum(len(r['late']) for r in tenants)}; GPUs over capacity "
            f"{max(len(r['over_capacity']) for r in tenants)}; hung {sum(r['hung'] for r in tenants)}.",
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
    tenants: list[TenantOutcome] = []

    def save() -> None:
        """The outcomes so far into --json, after every scenario: a long series stopped early keeps its runs."""
        if args.json:
            records = [o.__dict__ for o in outcomes] + [node.__dict__ for node in nodes]
            records += [tenant.__dict__ for tenant in tenants]
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
        if not args.only or any(word in TENANT_SCENARIO for word in args.only):
            tenant = run_tenant_within(args, work / f"tenant-{run_number}")
            tenants.append(tenant)
            save()
            print(f"\n{tenant.summary()}")
    save()
    clean = all(o.clean for o in outcomes) and all(node.clean for node in nodes) and all(t.clean for t in tenants)
    print("all counts 0" if clean else "SOME COUNTS ARE NOT 0", f"(work files in {work})")
    return 0 if clean else 1
