"""NodePrepareResources latency of the real ``gpushared serve`` in DRA mode as prepared claims add up.

The daemon runs as in production against the test fakes: the kubelet's DRA plugin client (gRPC over a unix
socket), the API server (HTTP on loopback) and NVML (the fake libnvidia-ml.so.1, four GPUs of 16, 12, 24 and
8 GiB counted in MiB). ``--claims`` claims of 16 MiB each are created already allocated (spread over the
GPUs, as a scheduler with consumable capacity would), then prepared one call each, one after another, on
this machine's disk: every prepare writes and fsyncs what the driver keeps. Reported per band of claims
already prepared: p50, p99 and max of the call as the kubelet measures it, and the longest gap between the
daemon's watchdog pings (its main loop) over the whole run.

    .venv/bin/python scripts/bench_dra_prepare.py --claims 2000 > bench/results/dra-prepare-2000.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import itertools

from gpushared.contract import dra
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.drakubelet import Claim, FakeDraKubelet
from tests.fakes.kubelet import FakeKubelet
from tests.fakes.nvml import FakeNvml, build_library
from tests.fakes.store import RESOURCES
from tests.fakes.systemd import NotifySocket
from tests.harness import NODE, Daemon, node_body, wait_until

NAMESPACE = "bench"
SIZES_MIB = (16384, 12288, 24576, 8192)
CLAIM_MIB = 16


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def allocated_claim(api: FakeApiServer, name: str, device: str) -> Claim:
    """A claim created, then allocated ``CLAIM_MIB`` of ``device`` in its status."""
    body = api.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": dra.DEVICE_CLASS}}]}},
        }
    )
    result = {
        "request": "gpu",
        "driver": dra.DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": f"{len(name):08x}-0000-0000-0000-{abs(hash(name)) % 10**12:012d}",
        "consumedCapacity": {dra.CAPACITY_MEMORY: f"{CLAIM_MIB}Mi"},
    }
    body["status"] = {"allocation": {"devices": {"results": [result]}}}
    api.store.update(RESOURCES["resourceclaims"], NAMESPACE, name, body, subresource="status", precondition_rv=None)
    return Claim(NAMESPACE, name, body["metadata"]["uid"])


def bands(total: int) -> list[tuple[int, int]]:
    """Bands of claims already prepared: [0, 10), [10, 100), ... up to ``total``, each 10 % of its top."""
    edges = [e for e in (10, 100, 500, 1000, 2000, 5000, 10000) if e <= total] or [total]
    return [(max(0, e - max(10, e // 10)), e) for e in edges]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=2000)
    args = parser.parse_args()
    capacity = sum(SIZES_MIB) // CLAIM_MIB
    if not 1 <= args.claims <= capacity:
        parser.error(f"--claims from 1 to {capacity}")
    with tempfile.TemporaryDirectory(prefix="bench-dra-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        (root / "kubelet").mkdir()
        library = build_library(root / "build")
        with (
            FakeApiServer() as api,
            FakeKubelet(root / "kubelet", seed=1) as kubelet,
            FakeDraKubelet(root / "kubelet") as dra_kubelet,
        ):
            api.create(node_body())
            api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
            notify = NotifySocket(root / "kubelet" / "notify.sock")
            nvml = FakeNvml.with_sizes(root / "nvml.json", library, *SIZES_MIB)
            daemon = Daemon(api=api, kubelet=kubelet, nvml=nvml, notify=notify, workdir=root)
            daemon.config = {
                "mode": "dra",
                "memoryUnit": "MiB",
                "dra": {"cdiRoot": str(root / "cdi")},
                "mps": {"enabled": False},
            }
            daemon.start()
            try:
                notify.wait_for("READY=1")
                dra_kubelet.wait_for(dra.DRIVER)
                wait_until(lambda: api.objects("resourceslices"), message="the node's ResourceSlice")
                devices = [d["name"] for d in api.objects("resourceslices")[0]["spec"]["devices"]]
                room = {d: size // CLAIM_MIB for d, size in zip(devices, SIZES_MIB, strict=True)}
                claims = []
                for i in range(args.claims):
                    device = max(room, key=lambda d: room[d])
                    room[device] -= 1
                    claims.append(allocated_claim(api, f"c{i:05d}", device))
                pings_before = len(notify.times("WATCHDOG=1"))
                latencies: list[float] = []
                started = time.monotonic()
                for made in claims:
                    before = time.perf_counter()
                    answer = dra_kubelet.prepare(dra.DRIVER, made)[made.uid]
                    latencies.append((time.perf_counter() - before) * 1000)
                    if answer.error:
                        raise SystemExit(f"claim {made.name} refused: {answer.error}")
                elapsed = time.monotonic() - started
                pings = list(notify.times("WATCHDOG=1")[pings_before:])
            finally:
                daemon.stop()
                notify.close()
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    report: dict[str, Any] = {
        "claims": args.claims,
        "seconds": round(elapsed, 2),
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "bands": [
            {
                "prepared_before": f"{low}-{high}",
                "count": len(latencies[low:high]),
                "p50_ms": round(percentile(latencies[low:high], 50), 2),
                "p99_ms": round(percentile(latencies[low:high], 99), 2),
                "max_ms": round(max(latencies[low:high]), 2),
            }
            for low, high in bands(args.claims)
        ],
        "all": {
            "p50_ms": round(percentile(latencies, 50), 2),
            "p99_ms": round(percentile(latencies, 99), 2),
            "max_ms": round(max(latencies), 2),
        },
        "watchdog_longest_gap_s": round(max(gaps), 3) if gaps else None,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
