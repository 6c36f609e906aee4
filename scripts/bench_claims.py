"""The claim allocator's speed (issue #54): pods per second it takes from gated to ungated with their claims
allocated, and each pod's latency from its creation to its gate removed, p50 and p99.

An API server (the fake one, tests/fakes/apiserver.py, HTTP on loopback, in this process) holds ``--nodes``
DRA nodes of 8 GPUs of 16 GiB, each with its inventory annotation and ResourceSlice. ``--pods`` pods are
created gated, each with its own claim of 1-8 GiB (``--rate`` per second, 0: all at once), and the
production allocator (extender/claimallocator.py, its book fed by real informers, the extender's cache
beside it) runs its loop on this process's event loop as the extender's leader does: a step every
``TICK_SECONDS``, its writes (the claim's status, the pod's gate) over HTTP. What it measures is the allocator
and the API calls it makes, not kube-scheduler's binding after it (no scheduler runs here).

    .venv/bin/python scripts/bench_claims.py --nodes 100 --pods 1000 --rate 0
    .venv/bin/python scripts/bench_claims.py --nodes 100 --pods 1000 --rate 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchkit.measure import percentiles

from gpushared.core.placement.policies import policy_named
from gpushared.core.shared.bodies import key_of
from gpushared.extender.claimallocator import TICK_SECONDS, AllocatorSettings
from gpushared.extender.claimwrites import Gate
from tests.claimworld import ClaimWorld, claim, dra_node, gated_pod
from tests.fakes.apiserver import FakeApiServer


async def measure(api: FakeApiServer, *, pods: int, rate: float, policy: str, seed: int) -> dict[str, Any]:
    world = ClaimWorld(api, AllocatorSettings(policy=policy_named(policy)))
    allocator = await world.start()
    created: dict[tuple[str, str], float] = {}
    ungated: dict[tuple[str, str], float] = {}
    remove_gate = allocator.writes.remove_gate

    async def timed_remove(pod: Any) -> Gate:
        done = await remove_gate(pod)
        if done is Gate.REMOVED:
            ungated[key_of(pod)] = time.perf_counter()
        return done

    allocator.writes.remove_gate = timed_remove  # type: ignore[method-assign]
    rng = random.Random(seed)

    async def create() -> None:
        for number in range(pods):
            api.create(claim(f"c{number}", memory=f"{rng.randint(1, 8)}Gi"))
            api.create(gated_pod(f"p{number}", f"c{number}"))
            created[("default", f"p{number}")] = time.perf_counter()
            if rate:
                await asyncio.sleep(1 / rate)

    started = time.perf_counter()
    creating = asyncio.ensure_future(create())
    deadline = started + 600
    while len(ungated) < pods and time.perf_counter() < deadline:  # ClaimAllocator.run's loop, until all are done
        allocator.step()
        await asyncio.sleep(0 if allocator.undecided else TICK_SECONDS)
    await creating
    await world.stop()
    latencies = [ungated[key] - created[key] for key in ungated if key in created]
    span = max(ungated.values()) - min(created.values()) if ungated else float("nan")
    return {
        "pods": pods,
        "rate": rate,
        "allocated": allocator.counts["allocated"],
        "ungated": len(ungated),
        "seconds": round(span, 3),
        "pods_per_second": round(len(ungated) / span, 1) if ungated else 0.0,
        "created_to_ungated": percentiles(latencies),
        "first_seen_to_ungated": percentiles(allocator.latencies) if allocator.latencies else {},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=0.0, help="pods created per second (0: all at once)")
    parser.add_argument("--policy", default="fgd")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    with FakeApiServer() as api:
        for number in range(args.nodes):
            dra_node(api, f"n{number:04d}", *([16] * 8))
        result = asyncio.run(measure(api, pods=args.pods, rate=args.rate, policy=args.policy, seed=args.seed))
    print(json.dumps({"nodes": args.nodes, "policy": args.policy, **result}, indent=2))


if __name__ == "__main__":
    main()
