"""The default check and --unit: NVML's costs, and MPS limits that hold for real CUDA clients."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpucheck import REPO, SCRIPT
from gpucheck.cuda import CLIENT, whole_gpu_sms
from gpucheck.report import finish


def nvml_costs(iterations: int) -> dict[str, float]:
    import pynvml

    costs: dict[str, float] = {}

    def timed(name: str, call: object) -> None:
        started = time.perf_counter()
        for _ in range(iterations):
            call()  # type: ignore[operator]
        costs[name] = round((time.perf_counter() - started) / iterations * 1e6, 2)

    started = time.perf_counter()
    pynvml.nvmlInit()
    costs["nvmlInit (once)"] = round((time.perf_counter() - started) * 1e6, 2)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    timed("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
    timed("nvmlDeviceGetHandleByIndex", lambda: pynvml.nvmlDeviceGetHandleByIndex(0))
    timed("nvmlDeviceGetUUID", lambda: pynvml.nvmlDeviceGetUUID(handle))
    timed("nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    timed("nvmlDeviceGetName", lambda: pynvml.nvmlDeviceGetName(handle))
    timed("nvmlDeviceGetComputeRunningProcesses", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    timed("nvmlDeviceGetGraphicsRunningProcesses", lambda: pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
    from gpushared.nvml import backend as nvml_backend
    from gpushared.nvml.backend import NvmlBackend

    # What NvmlBackend.devices() reads per GPU besides the calls above, through its own helpers.
    bus = nvml_backend._bus_id(handle)
    timed("MIG mode (_mig_enabled)", lambda: nvml_backend._mig_enabled(handle))
    timed("compute capability (_capability)", lambda: nvml_backend._capability(handle))
    timed("minor number (_minor)", lambda: nvml_backend._minor(handle))
    timed("PCI bus id (_bus_id)", lambda: nvml_backend._bus_id(handle))
    timed("NUMA node (_numa)", lambda: nvml_backend._numa(handle, bus))
    backend = NvmlBackend()
    backend.start()
    uuid = str(pynvml.nvmlDeviceGetUUID(handle))
    timed("NvmlBackend.processes() (the memory watcher's per-GPU read)", lambda: backend.processes(uuid))
    started = time.perf_counter()
    for _ in range(max(1, iterations // 10)):
        backend.devices()
    costs["NvmlBackend.devices() (the daemon's per-tick read)"] = round(
        (time.perf_counter() - started) / max(1, iterations // 10) * 1e6, 2
    )
    return costs


#: The [Service] settings of the unit that confine the daemon and what it starts (not how it is run).
SANDBOX = {
    "ProtectSystem", "ReadWritePaths", "ReadOnlyPaths", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
    "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock", "ProtectHostname",
    "ProtectProc", "RestrictNamespaces", "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
    "MemoryDenyWriteExecute", "SystemCallArchitectures", "SystemCallFilter", "SystemCallErrorNumber",
    "RestrictAddressFamilies", "CapabilityBoundingSet", "NoNewPrivileges", "UMask", "DevicePolicy", "DeviceAllow",
}  # fmt: skip


def unit_properties(*files: Path) -> list[str]:
    """``-p KEY=VALUE`` arguments for systemd-run: the sandbox settings of the unit, then of its drop-ins, in
    the order systemd applies them (an empty assignment resets a list, as in the files)."""
    properties = []
    for path in files:
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() in SANDBOX:
                properties += ["-p", f"{key.strip()}={value.strip()}"]
    return properties


def serve_mps(args: argparse.Namespace) -> int:
    """Inside the sandbox: start the GPU's MPS daemon, say where it is, wait until the outside is done."""
    from gpushared.daemon.mps import stop_daemon
    from gpushared.nvml.backend import NvmlBackend

    root = Path(args.serve_mps)
    backend = NvmlBackend()
    backend.start()
    gpu = next(g for g in backend.devices()[0] if g.index == args.gpu)
    supervisor = supervising(root, args.binary, backend, gpu)
    try:
        supervisor.check()
        (root / "daemon.json").write_text(json.dumps(supervisor.status()[0], default=str))
        deadline = time.monotonic() + 600
        while not (root / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
            supervisor.check()
        (root / "daemon-after.json").write_text(json.dumps(supervisor.status()[0], default=str))
    finally:
        stop_daemon(supervisor.settings, gpu.uuid, backend=backend)
        backend.stop()
    return 0


def check_in_process(args: argparse.Namespace) -> int:
    """The MPS supervisor in this process, two clients with different limits."""

    from gpushared.core.node.allocate import mps_client, thread_percentage
    from gpushared.daemon.mps import stop_daemon
    from gpushared.nvml.backend import NvmlBackend

    report: dict[str, object] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    report["nvml_call_microseconds"] = nvml_costs(args.iterations)
    backend = NvmlBackend()
    backend.start()
    gpu = next(g for g in backend.devices()[0] if g.index == args.gpu)
    report["gpu"] = {"index": gpu.index, "uuid": gpu.uuid, "model": gpu.model, "memory_mib": gpu.memory_mib,
                     "compute_capability": gpu.compute_capability, "driver": backend.driver_version()}  # fmt: skip
    gpu_sms = whole_gpu_sms(gpu.uuid)
    report["gpu"]["sms"] = gpu_sms  # type: ignore[index]
    root = Path(tempfile.mkdtemp(prefix="gpushared-check-"))
    supervisor = supervising(root, args.binary, backend, gpu)
    try:
        supervisor.check()
        [daemon] = supervisor.status()
        report["daemon"] = daemon
        if daemon["state"] != "running":
            report["verdict"] = f"MPS daemon did not start: {daemon['problem']}"
            return finish(report)
        clients = []
        for share in (0.25, 0.5):  # of the GPU's memory; threads follow as Allocate derives them
            limit_mib = int(gpu.memory_mib * share)
            percentage = thread_percentage(amount=limit_mib, gpu_memory=gpu.memory_mib, override=None)
            dirs = supervisor.answering()[gpu.uuid]
            envs, _ = mps_client(dirs, amount_mib=limit_mib, gpu_memory_mib=gpu.memory_mib, percentage=percentage)
            envs["CUDA_MPS_PIPE_DIRECTORY"] = str(root / gpu.uuid / "pipe")  # the host path: no container here
            env = {**os.environ, **envs, "CHECK_LIMIT_MIB": str(limit_mib)}
            # Inside the daemon's mount namespace, whose /dev/shm is the GPU's tmpfs, as in an MPS pod.
            argv = ["nsenter", "-t", str(daemon["pid"]), "-m", sys.executable, "-c", CLIENT]
            clients.append((limit_mib, percentage, subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                                                    stderr=subprocess.PIPE, text=True)))  # fmt: skip
        results = []
        for limit_mib, percentage, process in clients:
            out, err = process.communicate(timeout=300)
            results.append(judged(out, err, limit_mib=limit_mib, percentage=percentage, gpu_sms=gpu_sms))
        report["clients"] = results
        report["daemon_after_clients"] = supervisor.status()[0]
        held = all(r["memory_limit_held"] and r["thread_limit_held"] for r in results)
        failed = [r["error"].splitlines()[-1] for r in results if r.get("error")]
        if failed:
            report["verdict"] = f"CLIENTS FAILED TO RUN: {failed[0]}"
        else:
            report["verdict"] = "limits held" if held else "LIMITS NOT HELD: see clients"
    finally:
        report["stop"] = stop_daemon(supervisor.settings, gpu.uuid, backend=backend)
        backend.stop()
    return finish(report)


def judged(out: str, err: str, *, limit_mib: int, percentage: int, gpu_sms: int | None) -> dict[str, Any]:
    """A client's report, with whether its memory and thread limits held.

    ``device_sms`` is what the client read from the device attribute (under MPS: its share already), ``context_sms``
    what cuCtxGetExecAffinity gives its context; both must stay within ``percentage`` of ``gpu_sms``, the whole GPU.
    """
    body: dict[str, Any] = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": err.strip()[-500:]}
    expected_sms = -(-gpu_sms * percentage // 100) if gpu_sms else None
    body.update(limit_mib=limit_mib, thread_percentage=percentage, gpu_sms=gpu_sms, expected_sms_at_most=expected_sms)
    body["memory_limit_held"] = (
        body.get("over_limit_allocation") == "failed" and body.get("allocated_mib", 1 << 30) <= limit_mib
    )
    body["thread_limit_held"] = (
        body.get("context_sms") is not None and expected_sms is not None and body["context_sms"] <= expected_sms
    )
    return body


def check_in_unit(args: argparse.Namespace) -> int:
    """The daemon's MPS part in a transient service with the unit's sandbox; the clients from outside."""
    from gpushared.core.node.allocate import thread_percentage
    from gpushared.mps.control import GpuDirs
    from gpushared.nvml.backend import NvmlBackend

    if REPO.parts[1:2] in (("home",), ("root",)) or Path(sys.executable).resolve().parts[1:2] in (("home",), ("root",)):
        print(
            f"the unit's ProtectHome= hides {REPO}: run --unit from a checkout outside /home and /root", file=sys.stderr
        )
        return 2
    root = Path("/run/gpushared-check")
    root.mkdir(mode=0o755, exist_ok=True)
    for name in ("daemon.json", "daemon-after.json", "done"):
        (root / name).unlink(missing_ok=True)
    properties = unit_properties(REPO / "systemd" / "gpushared.service", REPO / "systemd" / "mps.conf")
    properties += ["-p", f"ReadWritePaths={root}", "-p", f"ReadOnlyPaths={REPO}"]
    argv = ["systemd-run", "--unit", "gpushared-check", "--collect", "--wait", *properties, "--",
            sys.executable, str(SCRIPT), "--serve-mps", str(root), "--gpu", str(args.gpu),
            "--binary", args.binary]  # fmt: skip
    report: dict[str, object] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sandbox": properties[1::2]}
    backend = NvmlBackend()
    backend.start()
    gpu = next(g for g in backend.devices()[0] if g.index == args.gpu)
    backend.stop()
    gpu_sms = whole_gpu_sms(gpu.uuid)  # before the sandboxed daemon starts
    service = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (root / "daemon.json").exists():
            if service.poll() is not None or time.monotonic() > deadline:
                report["verdict"] = f"the sandboxed MPS daemon did not start: {service.communicate()[0][-2000:]}"
                return finish(report)
            time.sleep(0.5)
        daemon = json.loads((root / "daemon.json").read_text())
        report["daemon"] = daemon
        if daemon["state"] != "running":
            report["verdict"] = f"MPS daemon did not start in the sandbox: {daemon['problem']}"
            return finish(report)
        limit_mib = gpu.memory_mib // 4
        percentage = thread_percentage(amount=limit_mib, gpu_memory=gpu.memory_mib, override=None)
        dirs = GpuDirs.of(root, gpu.uuid)
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(dirs.pipe), "CHECK_LIMIT_MIB": str(limit_mib),
               "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percentage),
               "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit_mib}M"}  # fmt: skip
        client = subprocess.run(
            ["nsenter", "-t", str(daemon["pid"]), "-m", sys.executable, "-c", CLIENT],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        body = judged(client.stdout, client.stderr, limit_mib=limit_mib, percentage=percentage, gpu_sms=gpu_sms)
        report["client"] = body
        (root / "done").touch()
        service.wait(timeout=60)
        report["daemon_after_client"] = json.loads((root / "daemon-after.json").read_text())
        held = "error" not in body and body["memory_limit_held"] and body["thread_limit_held"]
        report["verdict"] = "limits held" if held else f"UNDER THE UNIT'S SANDBOX: {body.get('error') or body}"
    finally:
        (root / "done").touch()
        if service.poll() is None:
            subprocess.run(["systemctl", "stop", "gpushared-check"], check=False)
    return finish(report)


def supervising(root: Path, binary: str, backend: Any, gpu: Any) -> Any:
    """gpushared's MPS supervisor for one GPU, built as the daemon builds it (its own code), synced to it."""
    from gpushared.daemon.health import Health
    from gpushared.daemon.metrics import DaemonMetrics
    from gpushared.daemon.mps import MpsSettings, MpsSupervisor

    settings = MpsSettings(root=root, binary=binary, exclusive_process=False, shm_size="25%", probe_seconds=5)
    health = Health(ignored_xids=(), recover_after=1)
    supervisor = MpsSupervisor(settings=settings, health=health, metrics=DaemonMetrics(), backend=backend)
    supervisor.sync([gpu])
    return supervisor
