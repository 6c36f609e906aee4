"""Timing samples and their percentiles, and pinning the measured process to a CPU of its own."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)

    return {"p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": round(1000 * ordered[-1], 3), "count": len(samples)}


def timed(samples: list[float], call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, its duration appended to ``samples``."""
    started = time.perf_counter()
    result = call(*args)
    samples.append(time.perf_counter() - started)
    return result


def pin(wanted: bool) -> set[int] | None:
    """With ``wanted``: this process, every thread it starts and every process it starts from now on, off the
    first CPU, which is returned for the process measured (the extender)."""
    if not wanted:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least 2 CPUs")
    os.sched_setaffinity(0, cpus[1:])  # only this thread exists yet: every thread started later inherits it
    return {cpus[0]}
