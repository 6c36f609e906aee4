"""The steerer's speed (issue #54): CPU-only pods per second it takes from gated to ungated with their
preference, and each pod's wait from its creation to its gate removed, p50 and p99: what steering costs a
pod that never needed a GPU.

An API server (the fake one, tests/fakes/apiserver.py, HTTP on loopback, in this process) holds ``--nodes``
DRA nodes of 8 GPUs of 16 GiB and as many nodes without GPUs. ``--pods`` CPU-only pods are created gated
(``--rate`` per second, 0: all at once), and the production steerer (extender/steering.py, the extender's
cache and the claim cache beside it fed by real informers) runs its loop on this process's event loop as the
leader does: a step every ``TICK_SECONDS``, each pod read and patched over HTTP.

    .venv/bin/python scripts/bench_steer.py --nodes 100 --pods 600 --rate 20
    .venv/bin/python scripts/bench_steer.py --nodes 100 --pods 1000 --rate 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchkit.measure import percentiles

from gpushared.extender.steering import TICK_SECONDS, Steerer, idle_ledger
from tests.claimworld import ClaimWorld, dra_node, steered_pod
from tests.fakes.apiserver import FakeApiServer


async def measure(api: FakeApiServer, *, pods: int, rate: float) -> dict[str, Any]:
    world = ClaimWorld(api)
    await world.start()
    steerer = Steerer(world.cache, world.aio, ledger_of=idle_ledger(world.cache, world.claim_cache))
    created: dict[str, float] = {}
    ungated: dict[str, float] = {}
    patch = world.aio.json_patch_pod

    async def timed_patch(namespace: str, name: str, operations: list[dict[str, Any]]) -> Any:
        done = await patch(namespace, name, operations)
        ungated[name] = time.perf_counter()
        return done

    world.aio.json_patch_pod = timed_patch  # type: ignore[method-assign]

    async def create() -> None:
        for number in range(pods):
            api.create(steered_pod(f"p{number}", cpu="1"))
            created[f"p{number}"] = time.perf_counter()
            if rate:
                await asyncio.sleep(1 / rate)

    creating = asyncio.ensure_future(create())
    deadline = time.perf_counter() + 600
    while (len(ungated) < pods or not creating.done()) and time.perf_counter() < deadline:  # Steerer.run's loop
        steerer.step()
        await asyncio.sleep(TICK_SECONDS)
    await creating
    await steerer.settle()
    await world.stop()
    waits = [ungated[name] - created[name] for name in ungated if name in created]
    span = max(ungated.values()) - min(created.values()) if ungated else float("nan")
    return {
        "pods": pods,
        "rate": rate,
        "steered": steerer.counts["steered"],
        "unsteered": steerer.counts["unsteered"],
        "seconds": round(span, 3),
        "pods_per_second": round(len(ungated) / span, 1) if ungated else 0.0,
        "created_to_ungated": percentiles(waits),
        "first_seen_to_ungated": percentiles(steerer.latencies) if steerer.latencies else {},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100, help="DRA nodes, and as many without GPUs")
    parser.add_argument("--pods", type=int, default=600)
    parser.add_argument("--rate", type=float, default=20.0, help="pods created per second (0: all at once)")
    args = parser.parse_args()
    with FakeApiServer() as api:
        for number in range(args.nodes):
            dra_node(api, f"g{number:04d}", *([16] * 8))
            api.create(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": f"c{number:04d}"},
                    "status": {"allocatable": {"cpu": "64", "memory": "256Gi"}},
                }
            )
        result = asyncio.run(measure(api, pods=args.pods, rate=args.rate))
    print(json.dumps({"nodes": 2 * args.nodes, **result}, indent=2))


if __name__ == "__main__":
    main()
