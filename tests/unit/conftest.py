"""Unit tests never wait on the wall clock (issue #40): a sleep of any length, in the test or in the code it
runs, fails the test; a test that needs time to pass injects a clock, and one that waits for another
thread or task waits for evidence (a condition, a turn of the loop)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import pytest

_real_asyncio_sleep = asyncio.sleep
_real_sleep = time.sleep


class WallClockSleep(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    def sleep(seconds: float) -> None:
        # The one sleep allowed: subprocess's own loop polling a child with a timeout for its exit, which is
        # waiting for evidence (a loaded machine lets a child close its pipes a moment before it exits).
        if sys._getframe(1).f_globals.get("__name__") == subprocess.__name__:
            _real_sleep(seconds)
            return
        raise WallClockSleep(f"time.sleep({seconds}) in a unit test: inject a clock, or wait for evidence")

    async def asleep(delay: float, result: Any = None) -> Any:
        if delay > 0:
            raise WallClockSleep(f"asyncio.sleep({delay}) in a unit test: inject a clock, or wait for evidence")
        return await _real_asyncio_sleep(0, result)

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(asyncio, "sleep", asleep)
