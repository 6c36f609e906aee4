"""GPU health rules (``core.node.health.judge_event``) as a table, like NVIDIA's plugin's health checks: which
events take a GPU out, and for how long (issue #39, defect 7)."""

from __future__ import annotations

import pytest

from gpushared.core.node.health import APPLICATION_XIDS, judge_event
from gpushared.daemon.health import Health

IGNORED = frozenset(APPLICATION_XIDS)
RECOVER = 300.0


@pytest.mark.parametrize(
    ("kind", "xid", "counts", "seconds", "reason"),
    [
        ("sbe", 0, False, 0.0, "single-bit ECC error (corrected by the hardware)"),  # once took a GPU out 300 s
        ("dbe", 0, True, RECOVER, "double-bit ECC error"),
        *[("xid", xid, False, 0.0, f"XID {xid} (an application's error)") for xid in APPLICATION_XIDS],
        ("xid", 79, True, RECOVER, "XID 79"),  # fallen off the bus
        ("xid", 48, True, RECOVER, "XID 48"),  # double-bit ECC, as an XID
        ("xid", 74, True, RECOVER, "XID 74"),  # NVLink error
        ("xid", 92, True, RECOVER, "XID 92"),  # a high single-bit error rate: the driver's own threshold
        ("xid", 94, True, RECOVER, "XID 94"),  # contained ECC error
        ("xid", 95, True, RECOVER, "XID 95"),  # uncontained ECC error
        ("xid", 63, True, RECOVER, "XID 63"),  # row remapping / page retirement
        ("power", 7, True, RECOVER, "GPU event 'power' (XID 7)"),  # unknown kind: unhealthy is the safe guess
    ],
)
def test_what_each_event_does(kind: str, xid: int, counts: bool, seconds: float, reason: str) -> None:
    verdict = judge_event(kind, xid, ignored_xids=IGNORED, recover_after=RECOVER)
    assert (verdict.counts, verdict.seconds, verdict.reason) == (counts, seconds, reason)


def test_the_ignored_xids_are_the_nodes_to_choose() -> None:
    assert judge_event("xid", 13, ignored_xids=frozenset(), recover_after=RECOVER).counts
    assert not judge_event("xid", 79, ignored_xids=frozenset({79}), recover_after=RECOVER).counts


def test_a_burst_of_corrected_errors_leaves_the_gpu_healthy() -> None:
    now = [0.0]
    health = Health(ignored_xids=IGNORED, recover_after=RECOVER, clock=lambda: now[0])
    for _ in range(1000):
        health.event("GPU-a", kind="sbe", xid=0, all_uuids=["GPU-a"])
    assert health.problem("GPU-a") is None
    health.event("GPU-a", kind="dbe", xid=0, all_uuids=["GPU-a"])
    assert health.problem("GPU-a") == "double-bit ECC error"
    now[0] = RECOVER
    assert health.problem("GPU-a") is None
