"""GPU health: ignored application XIDs, recovery after a quiet period, NVML failure."""

from __future__ import annotations

from gpushared.daemon.health import Health


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_application_xids_are_ignored() -> None:
    health = Health(ignored_xids=[13, 31], recover_after=10, clock=Clock())
    assert not health.event("GPU-a", kind="xid", xid=13, all_uuids=["GPU-a"]).counts
    assert health.problem("GPU-a") is None


def test_a_critical_xid_marks_one_gpu_until_it_has_been_quiet() -> None:
    clock = Clock()
    health = Health(ignored_xids=[13], recover_after=10, clock=clock)
    assert health.event("GPU-a", kind="xid", xid=79, all_uuids=["GPU-a", "GPU-b"]).counts
    assert (health.problem("GPU-a"), health.problem("GPU-b")) == ("XID 79", None)
    clock.now += 6
    health.event("GPU-a", kind="dbe", xid=0, all_uuids=[])  # a new event restarts the quiet period
    clock.now += 6
    assert health.problem("GPU-a") == "double-bit ECC error"
    clock.now += 4
    assert health.problem("GPU-a") is None


def test_an_event_without_a_gpu_marks_all() -> None:
    health = Health(ignored_xids=[], recover_after=10, clock=Clock())
    health.event(None, kind="xid", xid=48, all_uuids=["GPU-a", "GPU-b"])
    assert health.problem("GPU-a") == health.problem("GPU-b") == "XID 48"


def test_nvml_failure_marks_every_gpu_until_it_has_answered_for_the_quiet_period() -> None:
    clock = Clock()
    health = Health(ignored_xids=[], recover_after=10, clock=clock)
    health.backend_failed("GPU is lost")
    assert health.problem("GPU-x") == "NVML failed: GPU is lost"
    clock.now += 60
    assert health.problem("GPU-x") is not None  # still failing: no recovery however long
    health.backend_ok()
    clock.now += 9
    assert health.problem("GPU-x") is not None
    clock.now += 1
    assert health.problem("GPU-x") is None


def test_a_condition_holds_until_cleared_whatever_the_time() -> None:
    now = [0.0]
    health = Health(ignored_xids=(), recover_after=1, clock=lambda: now[0])
    health.condition("GPU-1", "MPS control daemon not answering")
    now[0] = 1000.0
    assert health.problem("GPU-1") == "MPS control daemon not answering"
    assert health.problem("GPU-2") is None
    health.condition("GPU-1", None)
    assert health.problem("GPU-1") is None
