"""What one memory poll of the node daemon costs: NVML's process lists, pidfds, cgroups and the decision.

The production ``MemoryWatcher`` polls the fake ``libnvidia-ml.so.1`` (through the real pynvml) with
``--gpus`` GPUs of ``--processes`` processes each. The processes are real (``sleep``, so that pidfds are
real); their ``/proc/<pid>/cgroup`` is a file in a directory that plays /proc, in containerd's systemd form,
one pod of one container per process, every one within its allocation (nothing is killed). Reported: CPU
time and wall time per poll over ``--polls`` polls.

    .venv/bin/python scripts/bench_memory_poll.py --gpus 8 --processes 50 --polls 200
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pynvml

from gpushared.contract import DEFAULT_RESOURCES, MemoryUnit
from gpushared.core.node.memory import Enforcement, MemoryPolicy
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from gpushared.daemon.memory import GpuView, MemoryWatcher
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.nvml.backend import NvmlBackend
from tests.builders import inventory, pod
from tests.fakes.nvml import FakeNvml, build_library


class NoEvents:
    def event(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing is over its allocation in this benchmark")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=50, help="per GPU (the fake lists at most 64)")
    parser.add_argument("--polls", type=int, default=200)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    nvml = FakeNvml.with_sizes(work / "nvml.json", build_library(work / "lib"), *[81920] * args.gpus)
    nvml.preload()
    inv = inventory(*[80] * args.gpus)
    proc = work / "proc"
    children: list[subprocess.Popen[bytes]] = []
    pods = []
    try:
        for gpu in range(args.gpus):
            listed = []
            for n in range(args.processes):
                child = subprocess.Popen(["sleep", "600"])
                children.append(child)
                uid = f"{gpu:08x}-0000-4000-8000-{n:012x}"
                container_id = f"{gpu:032x}{n:032x}"
                body = pod(f"p{gpu}-{n}", 1, node="n1", uid=uid, phase="Running")
                body["metadata"]["resourceVersion"] = str(1000 + len(pods))
                record = bind_annotations(pod_request(body), [inv.gpus[gpu]], unit=inv.unit, now_ns=1)
                body["metadata"]["annotations"].update(record)
                body["status"]["containerStatuses"] = [{"name": "c0", "containerID": f"containerd://{container_id}"}]
                pods.append(body)
                (proc / str(child.pid)).mkdir(parents=True)
                (proc / str(child.pid) / "cgroup").write_text(
                    "0::/kubepods.slice/kubepods-burstable.slice/"
                    f"kubepods-burstable-pod{uid.replace('-', '_')}.slice/cri-containerd-{container_id}.scope\n"
                )
                listed.append((child.pid, 700))
            nvml.gpus[gpu].processes = listed  # type: ignore[assignment]
        nvml.write()
        pynvml.nvmlInit()
        watcher = MemoryWatcher(
            backend=NvmlBackend(),
            gpus=lambda: [GpuView(i, g.uuid, g.memory_mib) for i, g in enumerate(nvml.gpus)],
            pods=lambda: pods,
            outbox=NoEvents(),  # type: ignore[arg-type]
            metrics=DaemonMetrics(),
            unit=MemoryUnit.GIB,
            resources=DEFAULT_RESOURCES,
            enforcement=Enforcement.KILL,
            policy=MemoryPolicy(),
            proc=proc,
        )
        first = watcher.poll()
        assert len(first.usages) == args.gpus * args.processes, "every process attributed"
        cpu, wall = [], []
        for _ in range(args.polls):
            c0, w0 = time.process_time(), time.perf_counter()
            decision = watcher.poll()
            cpu.append((time.process_time() - c0) * 1000)
            wall.append((time.perf_counter() - w0) * 1000)
            assert not decision.kills
    finally:
        for child in children:
            child.kill()
            child.wait()
    result = {
        "gpus": args.gpus,
        "processes_per_gpu": args.processes,
        "polls": args.polls,
        "cpu_ms_per_poll": {"median": statistics.median(cpu), "p99": percentile(cpu, 99)},
        "wall_ms_per_poll": {"median": statistics.median(wall), "p99": percentile(wall, 99)},
        "cpu_share_at_2s": statistics.median(cpu) / 2000,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
