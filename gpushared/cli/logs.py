"""Logging for the commands: journald's priorities under systemd, plain lines anywhere else.

systemd reads a ``<N>`` prefix on each line a service writes to the journal as the line's syslog priority
(``SyslogLevelPrefix=``, on by default), so that ``journalctl -u gpushared -p err`` finds the errors. Every
line of a message is prefixed, tracebacks included: an unprefixed continuation line would be ranked info.
systemd says the stream is the journal by setting ``JOURNAL_STREAM`` to its device and inode.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

#: Python's levels to syslog priorities (sd-daemon(3)).
PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
FORMAT = "%(levelname)s %(name)s: %(message)s"


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines() or [""])


def priority(level: int) -> int:
    """The syslog priority of a level; levels between Python's take the more severe neighbour's."""
    for threshold in sorted(PRIORITIES, reverse=True):
        if level >= threshold:
            return PRIORITIES[threshold]
    return PRIORITIES[logging.DEBUG]


def to_journal(stream: TextIO, environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether ``stream`` is the journal stream systemd connected (not a pipe the service made itself)."""
    device, _, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not device or not inode:
        return False
    try:
        status = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return f"{status.st_dev}:{status.st_ino}" == f"{device}:{inode}"


#: Libraries whose debug lines say nothing an operator of gpushared can use: HTTP/2's header codec logs
#: every header of every request it decodes.
CHATTY = ("hpack",)


def configure(level: str, stream: TextIO = sys.stderr) -> None:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter(FORMAT) if to_journal(stream) else logging.Formatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in CHATTY:
        logging.getLogger(name).setLevel(max(logging.INFO, logging.getLogger().level))
