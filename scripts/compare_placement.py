"""fgd held against binpack and the paper's FGD, trace by trace: the margins the placement goal is judged by.

Reads results of ``scripts/bench_openb.py`` (``openb*.json``: trace -> policy -> its mean curve over the seeds)
and the paper's curves (``--data``'s fgd-expected-results; a derived trace has none), and prints, per trace,
fgd less binpack and fgd less the paper's FGD at every 10 % of arrived workload from 50 to 130, the worst of
each, and whether the goal holds (both at or above -0.1). Later files override earlier ones for the same
trace and policy, so a re-run of one policy can be laid over a whole earlier run.

    .venv/bin/python scripts/compare_placement.py --results bench/results/openb.json bench/results/openb-pinning.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_openb import CURVE_POINTS, DEFAULT_DATA, paper_curves

#: The goal: fgd at or above binpack and the paper's FGD less this, at every point.
SLACK = 0.1
#: The paper's FGD among its published curves.
PAPER_FGD = "06-FGD"


def merged(paths: list[Path]) -> dict[str, dict[str, dict[str, float]]]:
    """trace -> policy -> point -> allocation, later files over earlier ones."""
    found: dict[str, dict[str, dict[str, float]]] = {}
    for path in paths:
        for trace, policies in json.loads(path.read_text()).items():
            for policy, figures in policies.items():
                if isinstance(figures, dict) and "curve" in figures:
                    found.setdefault(trace, {})[policy] = {k: float(v) for k, v in figures["curve"].items()}
    return found


def margins(results: dict[str, dict[str, dict[str, float]]], paper: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for trace in sorted(results):
        ours = results[trace]
        if "fgd" not in ours or "binpack" not in ours:
            continue
        fgd = ours["fgd"]
        row: dict[str, Any] = {"trace": trace}
        row["vsBinpack"] = {str(p): round(fgd[str(p)] - ours["binpack"][str(p)], 2) for p in CURVE_POINTS}
        theirs = paper.get(trace, {}).get(PAPER_FGD)
        if theirs is not None:
            row["vsFgd"] = {str(p): round(fgd[str(p)] - theirs[p], 2) for p in CURVE_POINTS}
        row["worstVsBinpack"] = min(row["vsBinpack"].values())
        row["worstVsFgd"] = min(row["vsFgd"].values()) if "vsFgd" in row else None
        row["met"] = row["worstVsBinpack"] >= -SLACK and (row["worstVsFgd"] is None or row["worstVsFgd"] >= -SLACK)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="+", type=Path, required=True, help="openb*.json files, later over earlier")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="where the paper's curves are")
    parser.add_argument("--json", action="store_true", help="print the margins as JSON")
    args = parser.parse_args()
    rows = margins(merged(args.results), paper_curves(args.data))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| trace | fgd - binpack, worst (at) | fgd - FGD, worst (at) | goal |")
    print("|---|---|---|---|")
    for row in rows:
        at = min(row["vsBinpack"], key=lambda p: row["vsBinpack"][p])
        paper = "—"
        if row["worstVsFgd"] is not None:
            at_fgd = min(row["vsFgd"], key=lambda p: row["vsFgd"][p])
            paper = f"{row['worstVsFgd']:+.2f} ({at_fgd} %)"
        met = "met" if row["met"] else "**missed**"
        print(f"| {row['trace']} | {row['worstVsBinpack']:+.2f} ({at} %) | {paper} | {met} |")


if __name__ == "__main__":
    main()
