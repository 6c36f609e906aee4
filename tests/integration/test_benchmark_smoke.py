"""Benchmarks run in CI only as smokes: they must work, their numbers are not judged here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_allocate_runs_and_reports() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_allocate.py"), "--pods", "4", "--background", "4"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["Allocate"]["count"] == 4
    assert report["GetPreferredAllocation"]["count"] == 4
    assert report["Allocate"]["p99_ms"] > 0
