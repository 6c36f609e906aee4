"""MPS needs CAP_SYS_ADMIN, which the unit grants only with its MPS drop-in: without it, say what to install."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushared.daemon.mps import MPS_DROP_IN, missing_mps_privilege


@pytest.mark.parametrize(
    ("effective", "missing"),
    [
        ("000001ffffffffff", False),  # root, every capability
        ("0000000000200000", False),  # CAP_SYS_ADMIN alone
        ("0000000000000022", True),  # CAP_DAC_OVERRIDE and CAP_KILL: the unit without its drop-in
        ("0000000000000000", True),
    ],
)
def test_missing_mps_privilege(tmp_path: Path, effective: str, missing: bool) -> None:
    status = tmp_path / "status"
    status.write_text(f"Name:\tgpushared\nCapInh:\t0000000000000000\nCapEff:\t{effective}\n")
    reason = missing_mps_privilege(status)
    assert (reason is not None) == missing
    assert reason is None or MPS_DROP_IN in reason


def test_an_unreadable_status_is_no_verdict(tmp_path: Path) -> None:
    assert missing_mps_privilege(tmp_path / "absent") is None
