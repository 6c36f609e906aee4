"""Choose the pinned-model pressure of binpack and fgd (``core.policies.BINPACK_PRESSURE``, ``FGD_PRESSURE``)
on a declared tuning set of traces, with the causal replay (issue #41); the traces it was not tuned on are
judged apart, by ``bench_openb.py --causal`` with the value chosen.

For each policy and each value of ``--values``, every tuning trace is replayed with ``--seeds``; a value's
margin at a point is our allocation less the paper's policy that policy is held against (binpack: BestFit,
fgd: FGD) at every 10 % of arrived workload from 50 to 130 %. The value chosen has the best worst margin over
the tuning traces and points, then the best mean. Writes ``--out`` (JSON): every value's margins, the value
chosen per policy, the traces and seeds, the command.

    .venv/bin/python scripts/tune_pressure.py                   # the declared tuning set, seeds 42-44
    .venv/bin/python scripts/tune_pressure.py --values 0 4 8 --policies binpack --traces gpuspec10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_openb import CURVE_POINTS, DEFAULT_DATA, GOALS, NODE_LIST, inputs, paper_curves, run_all

from gpushared.core.policies import binpack, fgd
from gpushared.replay.run import replay

ROOT = Path(__file__).resolve().parent.parent
#: The traces the pressures are tuned on: one where most GPU tasks are pinned to models and one where GPU
#: shares dominate. Every other trace is judged with the values chosen here and never tuned on.
TUNING_TRACES = ("gpuspec10", "gpushare40")
TUNING_SEEDS = (42, 43, 44)
VALUES = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0)
FACTORIES = {"binpack": binpack, "fgd": fgd}

Job = tuple[str, str, str, float, int]


def _run(job: Job) -> tuple[str, str, float, int, list[float]]:
    data, trace, policy, value, seed = job
    nodes, pods = inputs(data, trace)
    result = replay(nodes, pods, policy=FACTORIES[policy](value), seed=seed, causal=True)
    return trace, policy, value, seed, result.allocation


def margins(
    curves: dict[str, list[list[float]]], paper: dict[str, dict[str, list[float]]], policy: str
) -> dict[str, Any]:
    """Per trace: our mean curve less the paper's at each point; and the worst and mean over them all."""
    reference = GOALS[policy][0]
    per_trace: dict[str, dict[str, float]] = {}
    for trace, runs in curves.items():
        ours = [statistics.fmean(column) for column in zip(*runs, strict=True)]
        theirs = paper.get(trace, {}).get(reference)
        if theirs is None:
            continue
        per_trace[trace] = {str(point): round(ours[point] - theirs[point], 3) for point in CURVE_POINTS}
    every = [margin for points in per_trace.values() for margin in points.values()]
    return {
        "perTrace": per_trace,
        "worst": min(every) if every else float("nan"),
        "mean": round(statistics.fmean(every), 3) if every else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the trace's directory")
    parser.add_argument("--traces", nargs="*", default=list(TUNING_TRACES), help="the tuning set")
    parser.add_argument("--policies", nargs="*", default=list(FACTORIES), choices=list(FACTORIES))
    parser.add_argument("--values", nargs="*", type=float, default=list(VALUES))
    parser.add_argument("--seeds", nargs="*", type=int, default=list(TUNING_SEEDS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tuning-pressure.json")
    args = parser.parse_args()
    if not (args.data / NODE_LIST).exists():
        parser.error(f"no {NODE_LIST} in {args.data} (set --data or GPUSHARED_TRACE_DIR)")
    paper = paper_curves(args.data)
    jobs: list[Job] = [
        (str(args.data), trace, policy, value, seed)
        for policy in args.policies
        for value in args.values
        for trace in args.traces
        for seed in args.seeds
    ]
    started = time.monotonic()
    results = run_all(_run, jobs, workers=args.jobs)
    grid: dict[str, dict[str, Any]] = {}
    for policy in args.policies:
        grid[policy] = {}
        for value in args.values:
            curves: dict[str, list[list[float]]] = {}
            for trace, p, v, _, allocation in results:
                if p == policy and v == value:
                    curves.setdefault(trace, []).append(allocation)
            grid[policy][f"{value:g}"] = margins(curves, paper, policy)
    chosen = {
        policy: max(values, key=lambda v: (values[v]["worst"], values[v]["mean"])) for policy, values in grid.items()
    }
    report = {
        "command": " ".join(["scripts/tune_pressure.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "seconds": round(time.monotonic() - started),
        "tuningTraces": args.traces,
        "seeds": args.seeds,
        "replay": "causal (issue #41): the request mix counted from the tasks placed so far",
        "chosen": chosen,
        "grid": grid,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"chosen": chosen, **{p: {v: g["worst"] for v, g in vs.items()} for p, vs in grid.items()}}))


if __name__ == "__main__":
    main()
