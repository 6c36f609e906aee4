"""The MPS supervisor's pieces that need no daemon (what a container gets is tests/unit/test_allocate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushared.core.node.allocate import thread_percentage
from gpushared.mps import control as mps_control
from gpushared.mps.control import GpuDirs, MpsControl, MpsError


@pytest.mark.parametrize(
    ("amount", "memory", "override", "expected"),
    [
        (6, 24, None, 25),
        (1, 24, None, 5),  # rounded up: 4.17 -> 5
        (24, 24, None, 100),
        (1, 1000, None, 1),  # never 0: that would starve the client
        (6, 24, 60, 60),  # the pod's annotation wins
    ],
)
def test_thread_percentage_follows_the_memory_share(
    amount: int, memory: int, override: int | None, expected: int
) -> None:
    assert thread_percentage(amount=amount, gpu_memory=memory, override=override) == expected


@pytest.mark.parametrize("released_meanwhile", [True, False])
def test_releasing_the_shm_that_another_process_just_released_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, released_meanwhile: bool
) -> None:
    """`gpushared mps stop` and the running daemon's supervisor both release a stopped GPU's shm; the one
    whose umount finds it gone must not fail (it failed the operator's stop in CI). A umount that fails
    with the tmpfs still mounted is still an error."""
    control = MpsControl(binary="nvidia-cuda-mps-control", uuid="GPU-1", dirs=GpuDirs.of(tmp_path, "GPU-1"))
    mounted = iter([True, not released_meanwhile])
    monkeypatch.setattr(mps_control, "_is_mountpoint", lambda path, **_: next(mounted))

    def umount(argv: list[str]) -> None:
        raise MpsError(f"{' '.join(argv)}: umount: {argv[-1]}: not mounted.")

    monkeypatch.setattr(mps_control, "_run", umount)
    if released_meanwhile:
        control.release_shm()
    else:
        with pytest.raises(MpsError, match="not mounted"):
            control.release_shm()
