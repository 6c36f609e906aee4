"""A check's report: printed, written to $OUT when set, and kept under bench/results/gpu/."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from gpucheck import REPO


def finish(report: dict[str, object], *, passed: str = "limits held") -> int:
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu-check.json").write_text(text)
    keep(report, text)
    return 0 if report.get("verdict") == passed else 1


def keep(report: dict[str, object], text: str) -> None:
    """Every run's full output, under bench/results/gpu/ (issue #43: excerpts alone lost the failing runs)."""
    gpu = report.get("gpu")
    model = gpu.get("model", "gpu") if isinstance(gpu, dict) else "gpu"
    check = next((flag[2:] for flag in sys.argv if flag in ("--compute", "--memory", "--topology", "--unit")), "mps")
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{check}-{''.join(c if c.isalnum() else '-' for c in str(model))}.json"
    # GPU_CHECK_RESULTS: elsewhere (the tests' runs on the fake NVML are not results)
    folder = Path(os.environ.get("GPU_CHECK_RESULTS") or REPO / "bench" / "results" / "gpu")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text + "\n")
