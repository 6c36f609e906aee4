"""The driver's files under a driver root, and its device groups as systemd's DeviceAllow resolves them."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushared.nvml import driver

# /proc/devices of a node with NVIDIA's proprietary driver and MIG, and of one whose module registers major 195
# as "nvidia" (no frontend); block devices named nvidia-like must not count.
FRONTEND = """Character devices:
  1 mem
195 nvidia-frontend
234 nvidia-nvlink
235 nvidia-caps
236 nvidia-uvm

Block devices:
259 blkext
"""
PLAIN = "Character devices:\n  1 mem\n195 nvidia\n510 nvidia-uvm\n\nBlock devices:\n  8 sd\n"
NONE = "Character devices:\n  1 mem\n  4 tty\n\nBlock devices:\n  8 sd\n 77 nvidia-fake-block\n"


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        (FRONTEND, {"nvidia-frontend", "nvidia-nvlink", "nvidia-caps", "nvidia-uvm"}),
        (PLAIN, {"nvidia", "nvidia-uvm"}),
        (NONE, set()),
        ("", set()),
    ],
)
def test_device_groups(text: str, groups: set[str]) -> None:
    assert driver.device_groups(text) == frozenset(groups)


@pytest.mark.parametrize(
    ("at_start", "now", "restart"),
    [
        (set(), {"nvidia", "nvidia-uvm"}, True),  # the driver container loaded the module after the unit started
        ({"nvidia"}, {"nvidia", "nvidia-uvm"}, False),  # nvidia-uvm later: the glob had nvidia, NVML works
        (set(), set(), False),  # no driver yet: keep waiting
        ({"nvidia-frontend"}, {"nvidia-frontend"}, False),
    ],
)
def test_a_driver_loaded_after_start_needs_a_restart(at_start: set[str], now: set[str], restart: bool) -> None:
    assert driver.loaded_after_start(frozenset(at_start), frozenset(now)) is restart


def test_files_under_a_driver_root(tmp_path: Path) -> None:
    assert (
        driver.library_dir("/") is None and driver.binary("/", "nvidia-cuda-mps-control") == "nvidia-cuda-mps-control"
    )
    root = tmp_path / "run-nvidia-driver"
    assert driver.library_dir(str(root)) is None  # not there (yet): NVML reports it missing
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu" / driver.NVML_LIBRARY).touch()
    (root / "usr/bin").mkdir()
    (root / "usr/bin/nvidia-cuda-mps-control").touch()
    assert driver.library_dir(str(root)) == str(root / "usr/lib/x86_64-linux-gnu")
    assert driver.binary(str(root), "nvidia-cuda-mps-control") == str(root / "usr/bin/nvidia-cuda-mps-control")
    assert driver.binary(str(root), "/opt/mps/control") == "/opt/mps/control"  # a path is the admin's choice
