"""Log lines journald can rank: a <priority> prefix on every line, only when stderr is the journal."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from gpushared.cli import logs


@pytest.mark.parametrize(
    ("level", "priority"),
    [(logging.DEBUG, 7), (logging.INFO, 6), (logging.WARNING, 4), (logging.ERROR, 3), (logging.CRITICAL, 2), (35, 4)],
)
def test_priorities(level: int, priority: int) -> None:
    assert logs.priority(level) == priority


def test_every_line_of_a_traceback_keeps_the_records_priority() -> None:
    formatter = logs.JournalFormatter(logs.FORMAT)
    try:
        raise RuntimeError("lost GPU")
    except RuntimeError:
        record = logging.LogRecord("gpushared.x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    lines = formatter.format(record).splitlines()
    assert lines[0] == "<3>ERROR gpushared.x: failed"
    assert len(lines) > 3 and all(line.startswith("<3>") for line in lines)
    assert lines[-1] == "<3>RuntimeError: lost GPU"


def test_the_journal_is_recognised_by_device_and_inode(tmp_path: Path) -> None:
    with (tmp_path / "stream").open("w") as stream:
        status = os.fstat(stream.fileno())
        assert logs.to_journal(stream, {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino}"})
        assert not logs.to_journal(stream, {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino + 1}"})
        assert not logs.to_journal(stream, {})
