"""Allocate latency of the real ``gpushared serve`` process, pod lookup included.

The daemon runs as in production, against the test fakes: kubelet (gRPC over unix sockets, PodResources
included), API server (HTTP on loopback) and NVML (the fake libnvidia-ml.so.1). ``--background`` pods are
already running on the node, so every lookup walks a realistic pod manager; then ``--pods`` pods, placed by
the extender's own bind code on 8 GPUs, are admitted one after another. Reported: the time the daemon took
to answer each GetPreferredAllocation and Allocate, as the kubelet measures it.

    .venv/bin/python scripts/bench_allocate.py --pods 300 --background 100

Then the daemon is left alone for ``--idle-seconds`` with those pods on the node: its CPU and memory idle.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.apiserver import FakeApiServer
from tests.fakes.kubelet import FakeKubelet
from tests.fakes.nvml import FakeNvml, build_library
from tests.fakes.systemd import NotifySocket
from tests.harness import GPU_MEM, Daemon, node_body, wait_until


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--background", type=int, default=100)
    parser.add_argument("--idle-seconds", type=float, default=60, help="how long the idle daemon is watched")
    parser.add_argument(
        "--gpu-poll-seconds",
        type=float,
        default=5.0,
        help="the daemon's gpuPollSeconds: 5, the shipped default (the test harness's 0.5 reads NVML 10x as often)",
    )
    parser.add_argument(
        "--watchdog-seconds",
        type=float,
        default=30.0,
        help="WatchdogSec: 30, the shipped unit's (the test harness's 0.4 s makes the main loop tick 5x a second)",
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpsb-", dir="/tmp"))
    (root / "device-plugins").mkdir()
    work = root / "work"
    work.mkdir()
    try:
        with FakeApiServer() as api, FakeKubelet(root, seed=0) as kubelet:
            api.create(node_body())
            nvml = FakeNvml.with_sizes(work / "nvml.json", build_library(work / "lib"), *[81920] * 8)
            daemon = Daemon(
                api=api, kubelet=kubelet, nvml=nvml, notify=NotifySocket(root / "notify.sock"), workdir=work
            )
            daemon.config = {"logLevel": "warning", "gpuPollSeconds": args.gpu_poll_seconds}
            daemon.start(watchdog_usec=round(args.watchdog_seconds * 1e6))
            daemon.notify.wait_for("READY=1", timeout=30)
            kubelet.wait_for(GPU_MEM, capacity=8 * 80)
            wait_until(lambda: daemon.api.get("nodes", "node-1")["metadata"].get("annotations"), timeout=30)  # type: ignore[index]
            for i in range(args.background):
                daemon.admit(daemon.place(f"bg-{i}", 0 if i % 2 else 1, gpu=(i // 2) % 8))  # half use no GPU
            kubelet.timings.clear()
            started = time.perf_counter()
            for i in range(args.pods):
                daemon.admit(daemon.place(f"pod-{i}", 1, gpu=i % 8))
            wall = time.perf_counter() - started
            assert daemon.process is not None
            idle = idle_cost(psutil.Process(daemon.process.pid), seconds=args.idle_seconds)
            daemon.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"pods": args.pods, "background_pods": args.background, "machine": platform.machine(), "cpus": _cpus()}
    for rpc in ("GetPreferredAllocation", "Allocate"):
        times = [t * 1000 for name, t in kubelet.timings if name == rpc]
        report[rpc] = {
            "count": len(times),
            "p50_ms": round(percentile(times, 50), 2),
            "p99_ms": round(percentile(times, 99), 2),
            "max_ms": round(max(times), 2),
            "mean_ms": round(statistics.fmean(times), 2),
        }
    report["admissions_per_second"] = round(args.pods / wall, 1)
    report["idle"] = idle
    report["import_rss_mib"] = import_rss()
    print(json.dumps(report, indent=2))


def idle_cost(process: psutil.Process, *, seconds: float) -> dict[str, float]:
    """CPU (% of one core) the daemon spends while nothing is admitted, over ``seconds``, and its memory.

    Idle is not nothing: the watchdog ping, NVML health polling, the pod watch and ListAndWatch keep it busy
    a little; all threads and children count."""

    def cpu() -> float:
        times = process.cpu_times()
        return times.user + times.system + times.children_user + times.children_system

    def per_thread() -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in process.threads()}

    before, threads_before, started = cpu(), per_thread(), time.perf_counter()
    exact_before = _on_cpu(process)
    time.sleep(seconds)
    used, wall = cpu() - before, time.perf_counter() - started
    exact = {tid: ns - exact_before.get(tid, 0) for tid, ns in _on_cpu(process).items()}
    spent = {tid: busy - threads_before.get(tid, 0.0) for tid, busy in per_thread().items()}
    memory = process.memory_full_info()
    return {
        "seconds": round(wall, 1),
        "cpu_percent_of_one_core": round(100 * used / wall, 2),
        # The scheduler's own count of time on a CPU (nanoseconds), which /proc/PID/stat's clock ticks
        # (what the figure above sums) round to 10 ms per thread: over a minute, 0.017 % per thread.
        "cpu_percent_of_one_core_exact": round(100 * sum(exact.values()) / 1e9 / wall, 3),
        "rss_mib": round(memory.rss / 2**20, 1),
        "uss_mib": round(memory.uss / 2**20, 1),
        # Where it went: the busiest threads (Python's own names: `py-spy dump --pid <pid>` lists them by tid).
        "threads": [
            {
                "tid": tid,
                "comm": _comm(process.pid, tid),
                "cpu_percent_of_one_core": round(100 * spent.get(tid, 0.0) / wall, 3),
                "exact": round(100 * ns / 1e9 / wall, 4),
            }
            for tid, ns in sorted(exact.items(), key=lambda item: -item[1])
            if ns > 0
        ][:8],
    }


def _on_cpu(process: psutil.Process) -> dict[int, int]:
    """Each thread's time on a CPU so far, in ns (``/proc/PID/task/TID/schedstat``)."""
    found = {}
    for thread in process.threads():
        try:
            found[thread.id] = int(Path(f"/proc/{process.pid}/task/{thread.id}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return found


#: The daemon's libraries, by what they add to a fresh interpreter's RSS (the daemon imports its own modules
#: lazily; these it cannot do without).
LIBRARIES = ("grpc", "prometheus_client", "urllib3", "pynvml", "orjson,yaml,sdnotify")


def import_rss() -> dict[str, float]:
    """RSS (MiB) of a fresh interpreter with psutil, then what each of LIBRARIES adds to it, imported alone."""

    def rss(modules: str) -> float:
        code = (
            f"import importlib, psutil\nfor m in {modules!r}.split(','):\n    m and importlib.import_module(m)\n"
            "print(psutil.Process().memory_info().rss)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
        return int(out.stdout) / 2**20

    base = rss("")
    return {"interpreter": round(base, 1), **{name: round(rss(name) - base, 1) for name in LIBRARIES}}


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
