"""What an MPS container is given, derived from its gpu-mem (no daemon needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushared.daemon.health import Health
from gpushared.daemon.metrics import Metrics
from gpushared.daemon.mps import MpsSettings, MpsSupervisor, thread_percentage
from gpushared.mps import control as mps_control
from gpushared.mps.control import GpuDirs, MpsControl, MpsError
from gpushared.nvml.backend import GpuDevice


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


def test_container_setup_limits_memory_in_mib_on_ordinal_zero(tmp_path: Path) -> None:
    supervisor = MpsSupervisor(
        settings=MpsSettings(root=tmp_path, binary="x", exclusive_process=False, shm_size="1g", probe_seconds=1),
        health=Health(ignored_xids=(), recover_after=1),
        metrics=Metrics(),
        backend=None,  # type: ignore[arg-type]  # not reached
    )
    gpu = GpuDevice(index=3, uuid="GPU-3", model="T4", memory_mib=15360, mig_enabled=False, compute_capability=(7, 5))
    envs, mounts = supervisor.container_setup(gpu=gpu, amount_mib=4096, percentage=27)
    assert envs == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "27",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
    }
    assert [(m.container_path, m.host_path) for m in mounts] == [
        ("/tmp/nvidia-mps", str(tmp_path / "GPU-3" / "pipe")),
        ("/dev/shm", str(tmp_path / "GPU-3" / "shm")),
    ]
    # A GiB request on a GPU with a few MiB less than whole GiB never asks beyond the GPU.
    envs, _ = supervisor.container_setup(gpu=gpu, amount_mib=16384, percentage=100)
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=15360M"
    assert not supervisor.running("GPU-3")


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
