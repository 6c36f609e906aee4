"""The claim allocator's speed (issue #54): pods per second it takes from gated to ungated with their claims
allocated, and each pod's latency from its creation to its gate removed, p50 and p99.

An API server (the fake one, tests/fakes/apiserver.py, HTTP on loopback, in this process) holds ``--nodes``
DRA nodes of 8 GPUs of 16 GiB, each with its inventory annotation and ResourceSlice. ``--pods`` pods are
created gated, each with its own claim of 1-8 GiB (``--rate`` per second, 0: all at once), and the
production allocator (extender/claims/allocator.py, its claim cache fed by real informers, the extender's cache
beside it) runs its loop on this process's event loop as the extender's leader does: a step every
``TICK_SECONDS``, its writes (the claim's status, the pod's gate) over HTTP. What it measures is the allocator
and the API calls it makes, not kube-scheduler's binding after it (no scheduler runs here).

The fence's cost (``--ungated``): that fraction of the pods is created without the gate, as if the webhook
had been skipped. kube-scheduler may then be allocating their claims first fit, and the allocator writes
nothing meanwhile (``KUBE_WINDOW_SECONDS`` at most per such pod). ``--kube every`` stands in for
kube-scheduler: every 100 ms it allocates the ungated pods' claims first fit (``tests/claimworld.py``'s
``FirstFitScheduler``, its status writes over HTTP); ``--kube unschedulable``: the ungated pods ask for more
than any GPU has (32 GiB), so kube-scheduler could place them nowhere and nothing allocates them (pods
waiting for room, which kube-scheduler tries again later); ``--kube never``: they fit, and nothing allocates
them (kube-scheduler down: then it binds no pod, the allocator's included). The gated pods' latencies
against a run without ``--ungated`` are the fence's price; ``fence_holds`` and ``fenced_seconds`` say how often
and how long the fence held an allocation back (steps in which it held one, and the time they covered).

Beside the pods measured: ``--unplaceable N`` gated pods created first whose claims fit no GPU (32 GiB), which
wait for room the whole run and which every step turns through; ``--tenant-every S``: one tenant's pods, one
every S seconds, created without the gate with a 1 GiB claim, which kube-scheduler never places, so they stay
kube-scheduler's (``tests/claimtenant.py``): a required pod affinity no pod satisfies, which the fence does not
model, so it keeps their room (``--tenant-reason selector``: a node selector no node matches, which the
allocator reads, so the fence keeps their room nowhere). ``step`` is the allocator's steps' durations (each
decides for at most ``STEP_SECONDS``, then yields); ``pricings``, how many times a pod's kind was priced on
every candidate node.

What is listed before the pods measured is kept out of the garbage collector's walks (``gc.freeze``), as
the extender does once its caches are listed: here the fake API server shares the process, and its store
made full collections of 55-65 ms land in some steps.

    .venv/bin/python scripts/bench_claims.py --nodes 100 --pods 1000 --rate 0
    .venv/bin/python scripts/bench_claims.py --nodes 100 --pods 1000 --rate 50
    .venv/bin/python scripts/bench_claims.py --nodes 100 --pods 600 --rate 20 --ungated 0.05 --kube every
    .venv/bin/python scripts/bench_claims.py --nodes 100 --pods 600 --rate 20 --ungated 0.05 --kube unschedulable
    .venv/bin/python scripts/bench_claims.py --nodes 100 --pods 20 --rate 2 --unplaceable 2000
    .venv/bin/python scripts/bench_claims.py --nodes 100 --pods 20 --rate 1 --tenant-every 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
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
from gpushared.extender.claims.allocator import TICK_SECONDS, AllocatorSettings, ClaimAllocator
from gpushared.extender.claims.writes import Gate
from tests.claimtenant import unschedulable_pod
from tests.claimworld import ClaimWorld, FirstFitScheduler, claim, dra_node, gated_pod
from tests.fakes.apiserver import FakeApiServer


async def measure(
    api: FakeApiServer,
    *,
    pods: int,
    rate: float,
    policy: str,
    seed: int,
    ungated_share: float = 0.0,
    kube: str = "",
    unplaceable: int = 0,
    tenant_every: float = 0.0,
    tenant_reason: str = "affinity",
    deadline_seconds: float = 600.0,
) -> dict[str, Any]:
    world = ClaimWorld(api, AllocatorSettings(policy=policy_named(policy)))
    allocator = await world.start()
    await waiting_for_room(world, api, unplaceable)
    gc.freeze()  # what is listed kept out of the collector's walks, as the extender does once its caches are
    created: dict[tuple[str, str], float] = {}
    ungated = timed_ungates(allocator)
    rng = random.Random(seed)

    skipped: set[tuple[str, str]] = set()  # created without the gate: kube-scheduler's, not the allocator's

    async def create() -> None:
        for number in range(pods):
            gated = rng.random() >= ungated_share
            memory = "32Gi" if not gated and kube == "unschedulable" else f"{rng.randint(1, 8)}Gi"
            api.create(claim(f"c{number}", memory=memory))
            api.create(gated_pod(f"p{number}", f"c{number}", gated=gated))
            created[("default", f"p{number}")] = time.perf_counter()
            if not gated:
                skipped.add(("default", f"p{number}"))
            if rate:
                await asyncio.sleep(1 / rate)

    first_fit = FirstFitScheduler(api)
    stop = asyncio.Event()
    tenant_pods = [0]
    tenant_task = (
        asyncio.ensure_future(tenant(api, tenant_every, tenant_reason, stop, tenant_pods)) if tenant_every else None
    )
    await asyncio.sleep(3 * tenant_every)  # the tenant's first pods in the fence's window before the measured ones
    creating = asyncio.ensure_future(create())
    kube_task = asyncio.ensure_future(kube_scheduler(first_fit, stop)) if kube == "every" else None
    steps: list[float] = []
    deadline = time.perf_counter() + deadline_seconds
    fenced = 0.0
    last = time.perf_counter()
    while len(ungated) + len(skipped) < pods or not creating.done():  # ClaimAllocator.run's loop, until all are done
        if time.perf_counter() > deadline:
            break
        holds = allocator.counts["fenced"]
        began = time.perf_counter()
        allocator.step()
        now = time.perf_counter()
        steps.append(now - began)
        if allocator.counts["fenced"] > holds:  # a step in which the fence held an allocation back
            fenced += now - last
        last = now
        await asyncio.sleep(0 if allocator.undecided else TICK_SECONDS)
    stop.set()
    await creating
    for task in (kube_task, tenant_task):
        if task is not None:
            await task
    await world.stop()
    latencies = [ungated[key] - created[key] for key in ungated if key in created]
    span = max(ungated.values()) - min(created.values()) if ungated else float("nan")
    return {
        "pods": pods,
        "rate": rate,
        "unplaceable": unplaceable,
        "tenant_every": tenant_every,
        "tenant_reason": tenant_reason if tenant_every else None,
        "tenant_pods": tenant_pods[0],
        "ungated_at_creation": len(skipped),
        "kube": kube or "none",
        "kube_allocated": first_fit.allocated,
        "fence_holds": allocator.counts["fenced"],
        "fenced_seconds": round(fenced, 2),
        "not_gated_counted": allocator.counts["not_gated"],
        "allocated": allocator.counts["allocated"],
        "ungated": len(ungated),
        "seconds": round(span, 3),
        "pods_per_second": round(len(ungated) / span, 1) if ungated else 0.0,
        "created_to_ungated": percentiles(latencies) if latencies else {},
        "first_seen_to_ungated": percentiles(allocator.latencies) if allocator.latencies else {},
        "step": percentiles(steps),
        "pricings": getattr(allocator.placer, "pricings", None),  # absent before the placer counted them
    }


def timed_ungates(allocator: ClaimAllocator) -> dict[tuple[str, str], float]:
    """When the allocator removed each pod's gate, filled in as it does."""
    ungated: dict[tuple[str, str], float] = {}
    remove_gate = allocator.writes.remove_gate

    async def timed_remove(pod: Any) -> Gate:
        done = await remove_gate(pod)
        if done is Gate.REMOVED:
            ungated[key_of(pod)] = time.perf_counter()
        return done

    allocator.writes.remove_gate = timed_remove  # type: ignore[method-assign]
    return ungated


async def waiting_for_room(world: ClaimWorld, api: FakeApiServer, count: int) -> None:
    """``count`` gated pods whose claims fit no GPU, seen by the allocator and decided once each."""
    for number in range(count):
        api.create(claim(f"w{number}", memory="32Gi"))
        api.create(gated_pod(f"w{number}", f"w{number}"))
    while len(world.allocator.cache.claiming) < count or len(world.claim_cache.claims.get("default", {})) < count:
        world.allocator.cache.inbox.drain()
        world.claim_cache.drain()
        await asyncio.sleep(0.05)
    while count and len(world.allocator.told) < count:
        world.allocator.step()
        await asyncio.sleep(0)


async def tenant(api: FakeApiServer, every: float, reason: str, stop: asyncio.Event, made: list[int]) -> None:
    """One tenant's pods kube-scheduler never places, one every ``every`` seconds until ``stop``."""
    while not stop.is_set():
        name = f"tenant-{made[0]}"
        api.create(claim(name, memory="1Gi"))
        api.create(unschedulable_pod(name, name, reason=reason))
        made[0] += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def kube_scheduler(first_fit: FirstFitScheduler, stop: asyncio.Event) -> None:
    """kube-scheduler's own allocation of ungated pods' claims, first fit, every 100 ms until ``stop``."""
    while not stop.is_set():
        await asyncio.to_thread(first_fit.round)
        await asyncio.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=0.0, help="pods created per second (0: all at once)")
    parser.add_argument("--policy", default="fgd")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--ungated", type=float, default=0.0, help="share of pods created without the gate")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds the run may take at most")
    parser.add_argument(
        "--tenant-reason", choices=["affinity", "selector"], default="affinity", help="why kube-scheduler cannot"
    )
    parser.add_argument("--unplaceable", type=int, default=0, help="gated pods waiting for room, created first")
    parser.add_argument(
        "--tenant-every", type=float, default=0.0, help="seconds between a tenant's unschedulable ungated pods"
    )
    parser.add_argument(
        "--kube",
        choices=["every", "never", "unschedulable"],
        default="every",
        help="whether a first fit allocates the ungated pods' claims, or they fit nowhere",
    )
    args = parser.parse_args()
    with FakeApiServer() as api:
        for number in range(args.nodes):
            dra_node(api, f"n{number:04d}", *([16] * 8))
        result = asyncio.run(
            measure(
                api,
                pods=args.pods,
                rate=args.rate,
                policy=args.policy,
                seed=args.seed,
                ungated_share=args.ungated,
                kube=args.kube if args.ungated else "",
                unplaceable=args.unplaceable,
                tenant_every=args.tenant_every,
                tenant_reason=args.tenant_reason,
                deadline_seconds=args.deadline,
            )
        )
    print(json.dumps({"nodes": args.nodes, "policy": args.policy, **result}, indent=2))


if __name__ == "__main__":
    main()
