"""--memory: the memory watcher attributes, reports and kills a real CUDA client past its limit."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from gpucheck.cuda import GREEDY
from gpucheck.report import finish


def check_memory(args: argparse.Namespace) -> int:
    """A real CUDA process over its container's allocation, found through its cgroup and killed."""
    from gpushared import contract
    from gpushared.contract import DEFAULT_RESOURCES, GpuInfo, MemoryUnit
    from gpushared.core.node.memory import Enforcement, MemoryPolicy
    from gpushared.core.placement.binding import bind_annotations
    from gpushared.core.shared.requests import pod_request
    from gpushared.daemon.memory import GpuView, MemoryWatcher
    from gpushared.daemon.metrics import DaemonMetrics
    from gpushared.nvml.backend import NvmlBackend

    class Events:
        def __init__(self) -> None:
            self.sent: list[str] = []

        def event(self, body: object, reason: str, message: str, *, warning: bool) -> None:
            self.sent.append(f"{reason}: {message}")

    report: dict[str, object] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    backend = NvmlBackend()
    backend.start()
    gpu = next(g for g in backend.devices()[0] if g.index == args.gpu)
    uid, container_id = "c0ffee00-0000-4000-8000-00000000c4ec", "c4ec" * 16
    cgroup = Path("/sys/fs/cgroup/gpushared-check") / f"pod{uid}" / container_id
    cgroup.mkdir(parents=True, exist_ok=True)
    body: dict[str, object] = {
        "metadata": {"name": "gpu-check", "namespace": "default", "uid": uid, "annotations": {
            contract.POD_MEMORY_ENFORCEMENT: "kill"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "greedy", "resources": {"limits": {
            DEFAULT_RESOURCES.gpu_mem: "1"}}}]},
        "status": {"phase": "Running", "containerStatuses": [
            {"name": "greedy", "containerID": f"containerd://{container_id}"}]},
    }  # fmt: skip
    info = GpuInfo(index=gpu.index, uuid=gpu.uuid, model=gpu.model, memory=gpu.memory_mib // 1024,
                   memory_mib=gpu.memory_mib)  # fmt: skip
    record = bind_annotations(pod_request(body), [info], unit=MemoryUnit.GIB, now_ns=1)  # type: ignore[arg-type]
    body["metadata"]["annotations"].update(record)  # type: ignore[index]
    env = {**os.environ, "CHECK_HOLD_MIB": "3072", "CUDA_VISIBLE_DEVICES": gpu.uuid}
    client = subprocess.Popen([sys.executable, "-c", GREEDY], env=env, stdout=subprocess.PIPE, text=True)
    try:
        (cgroup / "cgroup.procs").write_text(str(client.pid))
        report["client_ready"] = client.stdout.readline().strip() if client.stdout else ""
        events = Events()
        watcher = MemoryWatcher(
            backend=backend,
            gpus=lambda: [GpuView(gpu.index, gpu.uuid, gpu.memory_mib)],
            pods=lambda: [body],  # type: ignore[list-item]
            outbox=events,  # type: ignore[arg-type]
            metrics=DaemonMetrics(),
            unit=MemoryUnit.GIB,
            resources=DEFAULT_RESOURCES,
            enforcement=Enforcement.REPORT,
            policy=MemoryPolicy(grace_seconds=0, tolerance_mib=256, reserve_mib=0),
        )
        started = time.perf_counter()
        decision = watcher.poll()
        report["poll_ms"] = round((time.perf_counter() - started) * 1000, 2)
        report["usages"] = [(u.ref.container, u.used_mib, u.allocated_mib, list(u.pids)) for u in decision.usages]
        report["kills"] = [(k.pid, k.used_mib, k.reason) for k in decision.kills]
        report["events"] = list(events.sent)
        code = client.wait(timeout=10)
        report["client_exit"] = code
        attributed = any(u.ref.container == "greedy" and client.pid in u.pids for u in decision.usages)
        killed = code == -9 and any(k.pid == client.pid for k in decision.kills)
        report["verdict"] = "memory watcher held" if attributed and killed else "MEMORY WATCHER DID NOT HOLD"
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        with contextlib.suppress(OSError):
            cgroup.rmdir()
            cgroup.parent.rmdir()
            cgroup.parent.parent.rmdir()
        backend.stop()
    return finish(report, passed="memory watcher held")
