"""What an ``--expected-mix`` file costs the real extender: filter latency and the longest event-loop turn,
per number of kinds in the file, up to the most it accepts (issue #52, item 2).

For each ``--kinds`` figure: a fake API server with ``--nodes`` gpushared nodes (1-8 GPUs of 8-24 GiB, CPUs
of 32-96 cores) and a third of their memory taken by running pods, the real ``gpushared-extender`` process
with ``--policy fgd`` and a file of that many random kinds (0: no file), then for ``--seconds`` a filter of
a new pod against every node, one after another, over HTTP, as kube-scheduler calls it. The mix is taken
again every 10 s on the event loop (``extender.state.MIX_SECONDS``), and every node is ranked again after
it: the run spans at least two of those. Reported: filter p50/p99/max and the extender's own
``gpushared_extender_event_loop_lag_max_seconds`` (the longest the loop was late to a 20 ms timer).

    .venv/bin/python scripts/bench_expected_mix.py --nodes 1000 --kinds 0 400 1000 2000 --seconds 25
    .venv/bin/python scripts/bench_expected_mix.py --nodes 1000 --kinds 400 1000 2000 --sizes 100000
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpushared.core.placement.mixbook import MAX_EXPECTED_KINDS
from tests.builders import pod
from tests.extender_harness import Extender, gpu_node
from tests.fakes.apiserver import FakeApiServer


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def expected_mix(kinds: int, rng: random.Random, *, sizes: int) -> dict[str, Any]:
    """``kinds`` distinct kinds: CPU, memory per GPU (1 to ``sizes`` units: 24 as GiB of a cluster's GPUs;
    the reader accepts up to 10^9, as a file counted in MiB, or a hostile one, has) and GPUs."""
    seen: set[tuple[int, int, int]] = set()
    while len(seen) < kinds:
        gpus = rng.choice([1, 1, 1, 1, 2, 4, 8])
        seen.add((rng.randrange(0, 64_000, 250), rng.randint(1, sizes if gpus == 1 else max(1, sizes * 2 // 3)), gpus))
    return {
        "weight": 1000,
        "kinds": [{"cpuMilli": c, "gpuMem": m, "gpus": g, "count": rng.randint(1, 50)} for c, m, g in sorted(seen)],
    }


def run(kinds: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with FakeApiServer(history=200_000) as api:
        names = []
        for i in range(args.nodes):
            name = f"node-{i:04d}"
            sizes = [rng.choice((8, 16, 24)) for _ in range(rng.choice((1, 2, 4, 8)))]
            api.create(gpu_node(name, *sizes, cpu=str(rng.choice((32, 64, 96)))))
            names.append(name)
            for gpu, size in enumerate(sizes):  # a third of it taken, by pods bound around the extender
                if rng.random() < 0.33:
                    running = pod(f"run-{i}-{gpu}", size // 2, node=name)
                    running["metadata"]["annotations"] = {
                        "ALIYUN_COM_GPU_MEM_IDX": str(gpu),
                        "ALIYUN_COM_GPU_MEM_POD": str(size // 2),
                        "ALIYUN_COM_GPU_MEM_ASSIGNED": "true",
                    }
                    api.create(running)
        extra = ["--policy", "fgd"]
        if kinds:
            path = work / f"mix-{kinds}.json"
            path.write_text(json.dumps(expected_mix(kinds, rng, sizes=args.sizes)))
            extra += ["--expected-mix", str(path)]
        extender = Extender(api=api, workdir=work, name=f"extender-{kinds}", args=extra).start()
        try:
            extender.wait_ready(120)
            latencies: list[float] = []
            stop_at = time.monotonic() + args.seconds
            n = 0
            while time.monotonic() < stop_at:
                body = pod(f"new-{n}", rng.randint(1, 12))
                n += 1
                started = time.perf_counter()
                status, answer = extender.filter(body, *names)
                latencies.append((time.perf_counter() - started) * 1000)
                if status != 200:
                    raise SystemExit(f"filter answered {status}: {answer}")
            status, text = extender.get("/metrics")
            lag = next(
                float(line.split()[1])
                for line in text.decode().splitlines()
                if line.startswith("gpushared_extender_event_loop_lag_max_seconds ")
            )
        finally:
            extender.stop()
    return {
        "kinds": kinds,
        "filters": len(latencies),
        "filter_p50_ms": round(percentile(latencies, 50), 2),
        "filter_p99_ms": round(percentile(latencies, 99), 2),
        "filter_max_ms": round(max(latencies), 2),
        "loop_lag_max_ms": round(lag * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--kinds", type=int, nargs="+", default=[0, 400, 1000, MAX_EXPECTED_KINDS])
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sizes", type=int, default=24, help="memory per GPU in the file, 1 to this many units")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-mix-") as tmp:
        results = [run(kinds, args, Path(tmp)) for kinds in args.kinds]
    print(json.dumps({"nodes": args.nodes, "seconds": args.seconds, "sizes": args.sizes, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
