"""The unit tests' guard against the wall clock (tests/unit/conftest.py): a sleep fails the test, but for the
standard library's own loop waiting for a child process to exit."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.unit.conftest import WallClockSleep


def test_a_sleep_fails_the_test() -> None:
    with pytest.raises(WallClockSleep, match=r"time.sleep\(0.01\) in a unit test"):
        time.sleep(0.01)


def test_a_child_that_closes_its_pipes_before_it_exits_is_waited_for() -> None:
    """subprocess.run with a timeout polls (sleeping) for the exit of a child whose pipes closed first, as any
    child's may on a loaded machine: here on purpose, for 0.2 s."""
    done = subprocess.run(
        ["sh", "-c", "exec >&- 2>&-; sleep 0.2; exit 3"], capture_output=True, timeout=10, check=False
    )
    assert done.returncode == 3
