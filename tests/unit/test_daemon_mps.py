"""What an MPS container is given, derived from its gpu-mem (no daemon needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushared.daemon.health import Health
from gpushared.daemon.metrics import Metrics
from gpushared.daemon.mps import MpsSettings, MpsSupervisor, thread_percentage
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
