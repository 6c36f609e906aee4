"""What choosing victims costs: one node's search, for the preempt verb (gpu-mem pods) and for the claim
allocator (claims, with groups of pods that share them), over nodes of 4 to 16 GPUs with 1 to 6 pods per GPU
at three priorities; and a hostile tenant's cost: a pod that finds no victims on any of 100 full nodes.

Each point draws ``--draws`` full nodes (every GPU filled by its pods, sizes and priorities at random, seed
fixed) and times the search for a pod of the highest priority asking 1 GPU, or half the node's GPUs, of
more memory than any GPU has free. Writes ``--out`` (JSON): per point the median, 95th percentile and most,
in ms, for ``select_victims`` (``verb``) and ``claim_victims`` (``claims``); and ``noVictims``: the ms a
pod of the lowest priority takes to be told no node has victims, over 100 nodes (each preemptor pays that at
most once every ``RETRY_SECONDS``; the claim allocator's search stops at its step's 20 ms).

    .venv/bin/python scripts/bench_preemption_cost.py --out bench/results/preemption-cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.placement.claims.preemption import ClaimPod, claim_victims
from gpushared.core.placement.preemption import Occupant, select_victims
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest

PRIORITIES = (0, 500, 1000)
SIZE = 80  # GiB, each GPU


def inventory(gpus: int) -> GpuInventory:
    return GpuInventory(
        unit=MemoryUnit.GIB,
        gpus=tuple(
            GpuInfo(index=i, uuid=f"GPU-{i:08x}", model="bench", memory=SIZE, memory_mib=SIZE * 1024)
            for i in range(gpus)
        ),
    )


def full_node(rng: random.Random, gpus: int, per_gpu: int) -> tuple[list[Holding], dict[str, int], dict[str, set[str]]]:
    """Every GPU split among ``per_gpu`` pods (sizes at random, summing to the GPU); a pod in ten shares its
    claim with the pod before it. Returns the holdings, pod -> priority, claim -> pods."""
    holdings: list[Holding] = []
    priority: dict[str, int] = {}
    claims: dict[str, set[str]] = {}
    for gpu in range(gpus):
        cuts = sorted(rng.sample(range(1, SIZE), per_gpu - 1)) if per_gpu > 1 else []
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, SIZE], strict=True)]
        for n, units in enumerate(sizes):
            name = f"g{gpu}-{n}"
            holdings.append(Holding(uid=f"{name}/gpu/dev", namespace="b", name=name, gpus={gpu: units}, assigned=True))
            priority[f"pod-{name}"] = rng.choice(PRIORITIES)
            claims[name] = {f"pod-{name}"}
            if n and rng.random() < 0.1:
                claims[name].add(f"pod-g{gpu}-{n - 1}")
    return holdings, priority, claims


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "medianMs": round(statistics.median(ordered), 3),
        "p95Ms": round(ordered[int(0.95 * (len(ordered) - 1))], 3),
        "maxMs": round(ordered[-1], 3),
    }


def point(rng: random.Random, gpus: int, per_gpu: int, wanted: int, draws: int) -> dict[str, Any]:
    request = PodRequest(containers=(ContainerRequest("c", (SIZE // 2 + 1) * wanted, gpus=wanted),))
    verb, claims_ms = [], []
    for _ in range(draws):
        holdings, priority, claims = full_node(rng, gpus, per_gpu)
        ledger = Ledger.build(inventory(gpus), holdings)
        # the verb: each holding a pod of its own
        pods_ledger = Ledger.build(
            ledger.inventory, [Holding(h.uid.split("/")[0], h.namespace, h.name, h.gpus) for h in holdings]
        )
        occupants = {h.uid.split("/")[0]: Occupant(priority[f"pod-{h.uid.split('/')[0]}"]) for h in holdings}
        started = time.perf_counter()
        select_victims(pods_ledger, request, priority=2000, occupants=occupants)
        verb.append((time.perf_counter() - started) * 1000)
        pods = {uid: ClaimPod(p) for uid, p in priority.items()}
        started = time.perf_counter()
        claim_victims(ledger, request, priority=2000, claims=claims, pods=pods, published=range(gpus))
        claims_ms.append((time.perf_counter() - started) * 1000)
    return {
        "gpus": gpus,
        "podsPerGpu": per_gpu,
        "gpusAsked": wanted,
        "verb": summary(verb),
        "claims": summary(claims_ms),
    }


def no_victims(rng: random.Random, nodes: int) -> dict[str, float]:
    """A lowest-priority pod over ``nodes`` full 8-GPU nodes of 4 pods per GPU: every search finds nothing."""
    request = PodRequest(containers=(ContainerRequest("c", SIZE // 2 + 1, gpus=1),))
    built = []
    for _ in range(nodes):
        holdings, priority, claims = full_node(rng, 8, 4)
        built.append((Ledger.build(inventory(8), holdings), {u: ClaimPod(p) for u, p in priority.items()}, claims))
    started = time.perf_counter()
    for ledger, pods, claims in built:
        claim_victims(ledger, request, priority=0, claims=claims, pods=pods, published=range(8))
    return {"nodes": nodes, "totalMs": round((time.perf_counter() - started) * 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--draws", type=int, default=30)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    points = [
        point(rng, gpus, per_gpu, wanted, args.draws)
        for gpus in (4, 8, 16)
        for per_gpu in (1, 2, 4, 6)
        for wanted in sorted({1, gpus // 2})
    ]
    result = {
        "command": "scripts/bench_preemption_cost.py " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "seed": args.seed,
        "draws": args.draws,
        "points": points,
        "noVictims": no_victims(rng, 100),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for p in points:
        print(
            f"{p['gpus']:>2} GPUs x {p['podsPerGpu']} pods, asks {p['gpusAsked']}: verb {p['verb']['medianMs']} / "
            f"{p['verb']['maxMs']} ms, claims {p['claims']['medianMs']} / {p['claims']['maxMs']} ms"
        )
    print("no victims over 100 nodes:", result["noVictims"])


if __name__ == "__main__":
    main()
