"""Preemption on the Alibaba GPU trace: what high-priority pods win, and what the low-priority ones pay.

Each task's priority comes from its ``qos`` (LS 1000; Guaranteed and Burstable 500; BE 0) and every run is the
FGD paper's replay (``gpushared.replay.run``: arrivals only, tuned to 130 % of the cluster's GPUs, the mix
counted as an extender counts it beside another trace's expected mix, as ``bench_openb.py`` does by default),
in each mode of ``gpushared.replay.priority``: ``off`` (a pod that fits nowhere fails), ``evict``
(kube-scheduler's preemption with the extender's preempt verb; victims are lost), ``requeue`` (the same, each
victim scheduled once more right after its preemptor). Writes ``preemption-<name>.json`` under ``--out``:

``{"runs": [...], "traces": {trace: {policy: {mode: {...}}}}}``, each mode's figures at every 10 % of arrived
workload from 50 to 130, means over the seeds: ``high``, ``middle``, ``low`` (GPU demand of that class placed
and still held, % of the class's GPU demand arrived; 100 while none arrived), ``total`` (allocation, % of the
cluster's GPU memory), ``evictedPods`` and ``evictedGpuMilli`` (so far), and, beside ``off``, the change against
it (``vsOff``: ``high`` and ``total`` in points, ``totalDropped``: whether total allocation fell at some point),
and every seed's numbers. A pod list without a ``qos`` column (multigpu20, multigpu30) is refused.

    .venv/bin/python scripts/bench_preemption.py --traces default --name default
    .venv/bin/python scripts/bench_preemption.py --traces gpushare40 gpuspec20 --modes off evict --name variants
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_openb import DEFAULT_DATA, NODE_LIST, POD_LIST, expected_for, inputs, run_all

from gpushared.replay.priority import (
    CLASSES,
    MODES,
    PRIORITY_OF_QOS,
    PriorityReplay,
    priority_replay,
    read_priorities,
)
from gpushared.replay.run import RATIO

ROOT = Path(__file__).resolve().parent.parent
#: The points reported: every 10 % of arrived workload from 50 % to 130 %.
POINTS = tuple(range(50, round(RATIO * 100) + 1, 10))


def _run(job: tuple[str, str, str, int, str, int]) -> tuple[str, PriorityReplay, float]:
    data, trace, policy, seed, mode, limit = job
    nodes, pods = inputs(data, trace)
    started = time.monotonic()
    result = priority_replay(
        nodes,
        pods[:limit] if limit else pods,
        priorities=read_priorities(Path(data) / POD_LIST.format(trace)),
        policy=policy,
        seed=seed,
        mode=mode,
        expected=expected_for(data, trace),
    )
    return trace, result, time.monotonic() - started


def _curve(series: list[list[float]] | list[list[int]]) -> dict[str, float]:
    return {str(p): round(statistics.fmean(s[p] for s in series), 2) for p in POINTS}


def summarize(results: list[tuple[str, PriorityReplay, float]]) -> dict[str, Any]:
    """{trace: {policy: {mode: figures}}}: means over the seeds at ``POINTS``, and each seed's numbers."""
    by: dict[str, dict[str, dict[str, list[tuple[PriorityReplay, float]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for trace, result, seconds in results:
        by[trace][result.policy][result.mode].append((result, seconds))
    out: dict[str, Any] = {}
    for trace in sorted(by):
        out[trace] = {}
        for policy in sorted(by[trace]):
            modes: dict[str, Any] = {}
            for mode in [m for m in MODES if m in by[trace][policy]]:
                runs = sorted(by[trace][policy][mode], key=lambda r: r[0].seed)
                replays = [r for r, _ in runs]
                modes[mode] = {
                    **{name: _curve([r.classes[name] for r in replays]) for name in CLASSES},
                    "total": _curve([r.allocation for r in replays]),
                    "evictedPods": _curve([r.evicted_pods for r in replays]),
                    "evictedGpuMilli": _curve([r.evicted_milli for r in replays]),
                    "evictedByClass": {
                        name: round(statistics.fmean(r.evicted_by_class[name] for r in replays), 1) for name in CLASSES
                    },
                    "preemptions": round(statistics.fmean(r.preemptions for r in replays), 1),
                    "retried": round(statistics.fmean(r.retried for r in replays), 1),
                    "retriedPlaced": round(statistics.fmean(r.retried_placed for r in replays), 1),
                    "nodesSearched": round(statistics.fmean(r.searches for r in replays)),
                    "seconds": round(statistics.fmean(s for _, s in runs), 1),
                    "seeds": {
                        r.seed: {
                            "high": {str(p): round(r.classes["high"][p], 2) for p in POINTS},
                            "total": {str(p): round(r.allocation[p], 2) for p in POINTS},
                            "evictedPods": r.evicted_pods[-1],
                            "evictedGpuMilli": r.evicted_milli[-1],
                            "placed": r.placed,
                            "failed": r.failed,
                            "arrivedGpuMilliByClass": r.arrived_by_class,
                        }
                        for r in replays
                    },
                }
            off = modes.get("off")
            for mode, figures in modes.items():
                if off is None or mode == "off":
                    continue
                total = {p: round(figures["total"][p] - off["total"][p], 2) for p in off["total"]}
                figures["vsOff"] = {
                    "high": {p: round(figures["high"][p] - off["high"][p], 2) for p in off["high"]},
                    "total": total,
                    "totalDropped": any(v < 0 for v in total.values()),
                }
            out[trace][policy] = modes
    return out


def table(traces: dict[str, Any]) -> str:
    """Per trace and policy: high-priority allocation without and with preemption at 80 / 100 / 130 % arrived,
    the pods evicted (and their GPUs) by 130 %, and the total allocation's change at those points."""
    head = ["trace", "policy", "mode", "LS off 80/100/130", "LS with 80/100/130", "evicted pods (GPUs)"]
    head += ["total off 80/100/130", "total change 80/100/130"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    at = ("80", "100", "130")
    for trace, policies in traces.items():
        for policy, modes in policies.items():
            off = modes.get("off")
            for mode, figures in modes.items():
                if mode == "off" or off is None:
                    continue
                cells = [trace, policy, mode]
                cells.append(" / ".join(f"{off['high'][p]:.2f}" for p in at))
                cells.append(" / ".join(f"{figures['high'][p]:.2f}" for p in at))
                cells.append(f"{figures['evictedPods']['130']:.0f} ({figures['evictedGpuMilli']['130'] / 1000:.1f})")
                cells.append(" / ".join(f"{off['total'][p]:.2f}" for p in at))
                cells.append(" / ".join(f"{figures['vsOff']['total'][p]:+.2f}" for p in at))
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the trace's directory")
    parser.add_argument("--traces", nargs="*", default=["default"], help="pod list suffixes")
    parser.add_argument("--policies", nargs="*", default=["fgd", "binpack"])
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--seeds", nargs="*", type=int, default=[42, 43, 44])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", default="openb", help="the file written: preemption-<name>.json")
    parser.add_argument("--limit", type=int, default=0, help="only the first that many tasks of each pod list")
    parser.add_argument("--table", action="store_true", help="only print --out's results as a markdown table")
    args = parser.parse_args()
    path = args.out / f"preemption-{args.name}.json"
    if args.table:
        print(table(json.loads(path.read_text())["traces"]))
        return
    if not (args.data / NODE_LIST).exists():
        parser.error(f"no {NODE_LIST} in {args.data} (set --data or GPUSHARED_TRACE_DIR)")
    for trace in args.traces:
        try:
            read_priorities(args.data / POD_LIST.format(trace))
        except ValueError as error:  # the multigpu lists: no qos, so no priorities to preempt by
            parser.error(str(error))
    jobs = [
        (str(args.data), t, p, s, m, args.limit)
        for t in args.traces
        for p in args.policies
        for s in args.seeds
        for m in args.modes
    ]
    started = time.monotonic()
    results = run_all(_run, jobs, workers=args.jobs)
    traces = summarize(results)
    run = {
        "command": " ".join(["scripts/bench_preemption.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "seconds": round(time.monotonic() - started),
        "priorities": dict(PRIORITY_OF_QOS),
        "candidateNodes": "10 % of the nodes, at least 100 (kube-scheduler's dry run)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": [run], "traces": traces}, indent=1) + "\n")
    print(table(traces))


if __name__ == "__main__":
    main()
