"""--compute: a client capped at its compute share runs on at most that share of the SMs."""

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

from gpucheck.cuda import SPIN_CLIENT, SPIN_PTX, whole_gpu_sms
from gpucheck.mps import supervising
from gpucheck.report import finish


def check_compute(args: argparse.Namespace) -> int:
    """Compute shares: a client whose pod's compute limit is 30 % against one without a limit, under MPS;
    then, without MPS, the compute watcher's reading of the same clients' SM use."""
    from gpushared import contract
    from gpushared.core.node.allocate import mps_client, thread_percentage
    from gpushared.daemon.mps import stop_daemon
    from gpushared.nvml.backend import NvmlBackend

    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    backend = NvmlBackend()
    backend.start()
    gpu = next(g for g in backend.devices()[0] if g.index == args.gpu)
    gpu_sms = whole_gpu_sms(gpu.uuid)
    report["gpu"] = {"index": gpu.index, "uuid": gpu.uuid, "model": gpu.model, "memory_mib": gpu.memory_mib,
                     "sms": gpu_sms, "driver": backend.driver_version()}  # fmt: skip
    # many more blocks than SMs: every SM the client may use gets some
    base = {"CHECK_PTX": SPIN_PTX, "CHECK_BLOCKS": str(16 * (gpu_sms or 132)), "CHECK_ITERS": str(args.spin_iterations)}
    limit = 30  # the pod's gpushared.io/gpu-compute-limit, read as the contract reads it
    share = contract.parse_compute({contract.POD_COMPUTE_LIMIT: str(limit)}) or contract.ComputeShare()
    root = Path(tempfile.mkdtemp(prefix="gpushared-check-"))
    supervisor = supervising(root, args.binary, backend, gpu)
    try:
        supervisor.check()
        [daemon] = supervisor.status()
        if daemon["state"] != "running":
            report["verdict"] = f"MPS daemon did not start: {daemon['problem']}"
            return finish(report, passed="compute capped")

        def client(percentage: int, start_at: float | None = None) -> subprocess.Popen[str]:
            dirs = supervisor.answering()[gpu.uuid]
            envs, _ = mps_client(
                dirs, amount_mib=gpu.memory_mib // 4, gpu_memory_mib=gpu.memory_mib, percentage=percentage
            )
            envs["CUDA_MPS_PIPE_DIRECTORY"] = str(root / gpu.uuid / "pipe")
            env = {**os.environ, **base, **envs, **({"CHECK_START_AT": str(start_at)} if start_at else {})}
            argv = ["nsenter", "-t", str(daemon["pid"]), "-m", sys.executable, "-c", SPIN_CLIENT]
            return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        capped_percentage = thread_percentage(amount=1, gpu_memory=gpu.memory_mib, override=share.limit)
        alone = {"capped": _spun(client(capped_percentage)), "uncapped": _spun(client(100))}
        at = time.time() + 15  # both past their JIT and warm-up launch, then timed together
        together = [client(capped_percentage, at), client(100, at)]
        both = {"capped": _spun(together[0]), "uncapped": _spun(together[1])}
        report["mps"] = _capped(alone, both, limit=limit, percentage=capped_percentage, gpu_sms=gpu_sms)
        if "error" in report["mps"]:
            report["verdict"] = f"CLIENTS FAILED TO RUN: {report['mps']['error']}"
            return finish(report, passed="compute capped")
    finally:
        report["stop"] = stop_daemon(supervisor.settings, gpu.uuid, backend=backend)
    report["without_mps"] = _sm_readings(backend, gpu.uuid, base)
    backend.stop()
    held = report["mps"]["occupancy_held"] and report["mps"]["capped_slower_alone"]
    samples = report["without_mps"]["sm_use_samples"]
    if held and samples and max(samples) > 0:
        report["verdict"] = "compute capped"
    else:
        report["verdict"] = "COMPUTE NOT CAPPED: see mps" if not held else "SM USE NOT MEASURED: see without_mps"
    return finish(report, passed="compute capped")


def _spun(process: subprocess.Popen[str]) -> dict[str, Any]:
    """A spinning client's report (SPIN_CLIENT), or its error."""
    out, err = process.communicate(timeout=600)
    return json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": err.strip()[-500:]}


def _capped(
    alone: dict[str, Any], both: dict[str, Any], *, limit: int, percentage: int, gpu_sms: int | None
) -> dict[str, Any]:
    """Whether the capped client stayed within its SMs (``%smid`` values) alone and beside the other, and
    ran slower alone than the uncapped one."""
    found: dict[str, Any] = {"limit_percent": limit, "thread_percentage": percentage, "alone": alone, "together": both}
    errors = [r["error"] for r in [*alone.values(), *both.values()] if "error" in r]
    if errors:
        return {**found, "error": errors[0].splitlines()[-1]}
    allowed = -(-(gpu_sms or 0) * percentage // 100)
    held = bool(gpu_sms) and alone["capped"]["sms_used"] <= allowed and both["capped"]["sms_used"] <= allowed
    ratio = alone["capped"]["blocks_per_second"] / alone["uncapped"]["blocks_per_second"]
    return {**found, "sms_allowed": allowed, "occupancy_held": held, "capped_slower_alone": ratio < 1,
            "throughput_ratio_alone": round(ratio, 3)}  # fmt: skip


def _sm_readings(backend: Any, uuid: str, base: dict[str, str]) -> dict[str, Any]:
    """Without MPS: what the compute watcher reads (NvmlBackend.sm_use) of one spinning client's SM use."""
    spinner = subprocess.Popen(
        [sys.executable, "-c", SPIN_CLIENT],
        env={**os.environ, **base, "CHECK_RUNS": "40"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    readings: list[int] = []
    since = 0
    while spinner.poll() is None and len(readings) < 20:
        time.sleep(0.5)
        use, since = backend.sm_use(uuid, since)
        if spinner.pid in use:
            readings.append(use[spinner.pid])
    return {"client": _spun(spinner), "sm_use_samples": readings}
