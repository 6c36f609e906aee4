"""What a GPU event means for the GPU's health: one pure decision, tested as a table
(``tests/unit/test_health_rules.py``) and listed in docs/daemon.md.

NVML reports three kinds of event the daemon listens for: a critical XID (``xid``, with its number), a
single-bit ECC error (``sbe``) and a double-bit ECC error (``dbe``). NVIDIA's device plugin counts critical
XIDs alone and never lets a GPU recover; gpushared counts the XIDs that say something about the GPU and the
uncorrectable ECC errors, and lets the GPU back after a quiet period:

- an **application XID** (a kernel of one pod faulting: 13, 31, 43, 45, 68, 109 by default,
  ``health.ignoredXids``) says nothing about the GPU: ignored;
- a **single-bit ECC error** was corrected by the hardware: ignored, however many come (a corrected one
  once took a GPU out for 300 s). A rate that matters reaches the daemon as an XID of its own (92, a high
  single-bit error rate; 94 and 95, contained and uncontained errors), which does count;
- a **double-bit ECC error** was not corrected: the GPU is out for ``recover_after`` seconds;
- **any other XID** (79: fallen off the bus, 48: double-bit error, 74: NVLink, 63/64: memory remapping,
  ...): out for ``recover_after`` seconds after the last one;
- an event of a kind this table does not know is counted like a critical XID: unhealthy is the safe guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: XIDs that one application's fault raises (NVIDIA's plugin skips the same ones): nothing about the GPU.
APPLICATION_XIDS: Final = (13, 31, 43, 45, 68, 109)


@dataclass(frozen=True)
class EventVerdict:
    """What one GPU event does: ``counts`` False leaves the GPU as it was; True makes it unhealthy for
    ``seconds`` after the event, for ``reason``."""

    counts: bool
    reason: str
    seconds: float = 0.0


def judge_event(kind: str, xid: int, *, ignored_xids: frozenset[int], recover_after: float) -> EventVerdict:
    """The health rule for one event of ``kind`` (``xid``, ``sbe``, ``dbe``) with XID number ``xid``."""
    if kind == "sbe":
        return EventVerdict(False, "single-bit ECC error (corrected by the hardware)")
    if kind == "dbe":
        return EventVerdict(True, "double-bit ECC error", recover_after)
    if kind == "xid" and xid in ignored_xids:
        return EventVerdict(False, f"XID {xid} (an application's error)")
    if kind == "xid":
        return EventVerdict(True, f"XID {xid}", recover_after)
    return EventVerdict(True, f"GPU event {kind!r} (XID {xid})", recover_after)
