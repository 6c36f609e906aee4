"""How well linked the GPUs of the trace's multi-GPU tasks are, by policy, with placement blind to links and
seeing them (issue #24).

Alibaba's trace names no link, so each node gets the links of a common machine of its GPU model
(``gpushared.replay.layouts.model_layout``: V100 servers as DGX-1s, others as 2-socket PCIe servers).
Every trace with multi-GPU tasks (or those named), every policy, seeds 42-46, each replayed twice: with the
links hidden from placement (as before #24) and shown. Per run: the mean link score of the sets the placed
multi-GPU tasks got, as % of the best set of that size on their node (``set_score``, summed over tasks);
how many of those tasks landed on NVLink nodes, and how many of them got only NVLink pairs; the
allocation at 100 and 130 % arrived, so that the price of weighing links shows. Writes ``links.json`` under
``--out`` and prints the table docs/benchmarks.md carries.

    .venv/bin/python scripts/bench_links.py                      # what `make bench` runs after bench_openb
    .venv/bin/python scripts/bench_links.py --traces multigpu30 --policies binpack --seeds 42
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpushared.core.placement.policies import POLICIES
from gpushared.replay.run import SEEDS, Replay, replay
from scripts.bench_openb import DEFAULT_DATA, NODE_LIST, ROOT, inputs, run_all

#: The traces whose tasks are most often on several GPUs, and the default one.
TRACES = ("default", "multigpu20", "multigpu30")


def _run(job: tuple[str, str, str, int, bool]) -> tuple[str, Replay]:
    data, trace, policy, seed, links = job
    nodes, pods = inputs(data, trace)
    return trace, replay(nodes, pods, policy=policy, seed=seed, links=links, causal=False)


def summarize(results: list[tuple[str, Replay]]) -> dict[str, Any]:
    """{trace: {policy: {"blind"|"seen": numbers}}}, means over the seeds."""
    by: dict[tuple[str, str, str], list[Replay]] = defaultdict(list)
    for trace, result in results:
        by[trace, result.policy, "seen" if result.links_seen else "blind"].append(result)
    summary: dict[str, Any] = defaultdict(lambda: defaultdict(dict))
    for (trace, policy, mode), runs in sorted(by.items()):
        tallies = [r.links for r in runs if r.links is not None]
        summary[trace][policy][mode] = {
            "multiGpuPlaced": round(statistics.fmean(t.tasks for t in tallies), 1),
            "scorePctOfBest": round(100 * sum(t.score for t in tallies) / max(sum(t.best for t in tallies), 1), 2),
            "meanSetScore": round(sum(t.score for t in tallies) / max(sum(t.tasks for t in tallies), 1), 1),
            "onNvlinkNodes": round(statistics.fmean(t.on_nvlink_nodes for t in tallies), 1),
            "allNvlinkPct": round(
                100 * sum(t.all_nvlink for t in tallies) / max(sum(t.on_nvlink_nodes for t in tallies), 1), 1
            ),
            "allocation100": round(statistics.fmean(r.allocation[100] for r in runs), 2),
            "allocation130": round(statistics.fmean(r.allocation[-1] for r in runs), 2),
            "seeds": sorted(r.seed for r in runs),
        }
    return json.loads(json.dumps(summary))  # plain dicts, in order


def table(summary: dict[str, Any]) -> str:
    head = [
        "trace",
        "policy",
        "links",
        "multi-GPU placed",
        "set score % of best",
        "mean set score",
        "on NVLink nodes",
        "all-NVLink %",
        "alloc 100 / 130",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for trace, policies in summary.items():
        for policy, modes in policies.items():
            for mode in ("blind", "seen"):
                if mode not in modes:
                    continue
                n = modes[mode]
                lines.append(
                    f"| {trace} | {policy} | {mode} | {n['multiGpuPlaced']} | {n['scorePctOfBest']:.2f} | "
                    f"{n['meanSetScore']} | {n['onNvlinkNodes']} | {n['allNvlinkPct']} | "
                    f"{n['allocation100']:.2f} / {n['allocation130']:.2f} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the trace's directory")
    parser.add_argument("--traces", nargs="*", default=list(TRACES))
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS[:5]))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if not (args.data / NODE_LIST).exists():
        parser.error(f"no {NODE_LIST} in {args.data} (set --data or GPUSHARED_TRACE_DIR)")
    jobs = [
        (str(args.data), t, p, s, links)
        for t in args.traces
        for p in args.policies
        for s in args.seeds
        for links in (False, True)
    ]
    started = time.monotonic()
    summary = summarize(run_all(_run, jobs, workers=args.jobs))
    args.out.mkdir(parents=True, exist_ok=True)
    body = {
        "command": " ".join(["scripts/bench_links.py", *sys.argv[1:]]),
        "seconds": round(time.monotonic() - started),
        "traces": summary,
    }
    (args.out / "links.json").write_text(json.dumps(body, indent=1) + "\n")
    print(table(summary))


if __name__ == "__main__":
    main()
