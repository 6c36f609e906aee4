"""What the extender's request limits cost its event loop: parsing a body of each size (the body limit,
--max-body-mib) and checking a request that names the most candidates (--max-nodes). Each runs on the
loop, so each is how long one request can hold /healthz. Figures: docs/benchmarks.md.

    .venv/bin/python scripts/bench_limits.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpushared.extender.http import wire
from tests.builders import pod


def best_ms(action: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best, median) milliseconds of ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return round(min(times) * 1000, 1), round(statistics.median(times) * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("body (MiB)  node names  orjson.loads ms (best, median)  parse_args ms (best, median)")
    for count in (15_000, 60_000, 120_000, 250_000, 560_000, 1_000_000):
        body = orjson.dumps({"Pod": pod("p", 1), "NodeNames": [f"node-{i:07d}" for i in range(count)]})
        parsed = best_ms(lambda body=body: orjson.loads(body), args.repeat)
        checked = best_ms(lambda body=body: wire.parse_args(body, verb="filter", max_nodes=10**8), args.repeat)
        print(f"{len(body) / 2**20:>10.2f}  {count:>10,}  {parsed!s:>30}  {checked!s:>28}")


if __name__ == "__main__":
    main()
