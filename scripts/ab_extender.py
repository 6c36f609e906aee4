"""Which source tree's extender spends less CPU per filter+bind: a paired comparison of two or more trees.

On a shared machine the CPU time of the same work moves by 15-40 % between runs minutes apart, so two
single runs of bench_extender.py cannot tell a 10 % change. Here one fake API server is filled once, and
each round starts every tree's ``gpushared-extender`` in turn against it (the order reversed every other
round), alone on the first CPU, and runs bench_extender.py's sustained filter+bind on it. Each run reports
the extender's CPU per filter+bind, and that divided by the caller's: the caller does the same work per
filter+bind whichever tree answers, so the ratio takes out how fast the machine was during that run.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python scripts/ab_extender.py /tmp/before . --nodes 2500 --pods 50000 --rounds 3

Each tree's extender is its own ``gpushared`` package (``python -m gpushared.cli.extender`` run in the tree),
with this checkout's virtualenv. The report (JSON, on stdout) keeps every run and each tree's medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_extender import FakeBackend, pin, populate, sustained

from tests.extender_harness import Extender
from tests.fakes.apiserver import FakeApiServer


def run_once(
    tree: Path, backend: FakeBackend, names: list[str], args: argparse.Namespace, rng: random.Random, *, run: int
) -> dict[str, float]:
    """One tree's sustained run. Pods bound in earlier runs stay (the cluster fills a little more with each
    run): the order of the trees, reversed every other round, spreads that evenly."""
    extender = Extender(
        api=None,
        kubeconfig=backend.kubeconfig,
        workdir=Path(tempfile.mkdtemp(prefix="gps-ab-")),
        # no fence: the pods earlier runs left pending are this benchmark's, no Binding of theirs is in flight
        # (an extender that finds pods pending at its start otherwise waits --binding-landing-seconds to bind;
        # 1 s, the least the option takes)
        args=["--policy", args.policy, "--log-level", "info", "--binding-landing-seconds", "1"],
        cpus=args.extender_cpus,
        cwd=tree,
    )
    extender.start()
    try:
        extender.wait_ready(timeout=3600)
        assert extender.process is not None
        process = psutil.Process(extender.process.pid)
        measured = sustained(backend, names, args, rng, port=extender.port, extender=process, prefix=f"ab{run}")
    finally:
        extender.stop()
    extender_ms, caller_ms = measured["extenderCpuMsPerFilterPlusBind"], measured["callerCpuMsPerFilterPlusBind"]
    return {
        "filterPlusBindPerSecond": measured["filterPlusBindPerSecond"],
        "extenderCpuMs": extender_ms,
        "callerCpuMs": caller_ms,
        "extenderPerCallerCpu": round(extender_ms / caller_ms, 3) if caller_ms else 0.0,
        "bindErrors": measured["sustainedBindErrors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees, each with a gpushared/ package")
    parser.add_argument("--nodes", type=int, default=2500)
    parser.add_argument("--pods", type=int, default=50000, help="running pods in the cache")
    parser.add_argument("--candidates", type=int, default=500, help="node names per filter call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10, help="length of each sustained filter+bind run")
    parser.add_argument("--rate-pods", type=int, default=8000, help="pods created for each run")
    parser.add_argument("--policy", default="binpack")
    parser.add_argument("--bind-workers", type=int, default=16, help="binds in flight")
    args = parser.parse_args()
    args.filter_alone_seconds = 0
    trees = [tree.resolve() for tree in args.trees]
    for tree in trees:
        if not (tree / "gpushared" / "cli" / "extender.py").is_file():
            parser.error(f"{tree} holds no gpushared/cli/extender.py")
    args.extender_cpus = pin(True)
    rng = random.Random(42)
    runs: dict[str, list[dict[str, float]]] = {str(tree): [] for tree in trees}
    with contextlib.ExitStack() as stack:
        backend = FakeBackend(stack.enter_context(FakeApiServer(history=1_000_000)))
        names = populate(backend, nodes=args.nodes, pods=args.pods, rng=rng)
        order = [(number, tree) for number in range(args.rounds) for tree in trees[:: 1 if number % 2 == 0 else -1]]
        for run, (number, tree) in enumerate(order):
            row = run_once(tree, backend, names, args, rng, run=run)
            runs[str(tree)].append(row)
            print(f"round {number} {tree}: {json.dumps(row)}", file=sys.stderr, flush=True)
    medians = {
        tree: {key: statistics.median(row[key] for row in rows) for key in ("extenderCpuMs", "extenderPerCallerCpu")}
        for tree, rows in runs.items()
    }
    print(json.dumps({"nodes": args.nodes, "pods": args.pods, "runs": runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
