"""Unit tests never wait on the wall clock (issue #40): a sleep of any length, in the test or in the code it
runs, fails the test; a test that needs time to pass injects a clock, and one that waits for another
thread or task waits for evidence (a condition, a turn of the loop)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

_real_asyncio_sleep = asyncio.sleep


class WallClockSleep(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    def sleep(seconds: float) -> None:
        raise WallClockSleep(f"time.sleep({seconds}) in a unit test: inject a clock, or wait for evidence")

    async def asleep(delay: float, result: Any = None) -> Any:
        if delay > 0:
            raise WallClockSleep(f"asyncio.sleep({delay}) in a unit test: inject a clock, or wait for evidence")
        return await _real_asyncio_sleep(0, result)

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(asyncio, "sleep", asleep)
