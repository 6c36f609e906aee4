"""The device files deviceNodes hands over: which exist, and the /dev/char links runc needs to record them."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from gpushared.core.node.exposure import DeviceFile, ExposurePolicy
from gpushared.daemon.devfiles import CharLinks, present_devices

needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="making character devices needs root")


def chardev(path: Path, major: int, minor: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, minor))
    return path


def test_present_devices_names_gpu_files_and_control_devices_that_exist(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / "dev").mkdir(exist_ok=True)
        (tmp_path / "dev" / name).touch()
    policy = ExposurePolicy(dev_root=str(tmp_path))
    assert present_devices(policy, [0, 3, 5, None]) == [
        "/dev/nvidia0",
        "/dev/nvidia3",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    ]


@needs_mknod
def test_links_are_made_for_character_devices_and_existing_ones_kept(tmp_path: Path) -> None:
    gpu = chardev(tmp_path / "drv" / "dev" / "nvidia3", 195, 3)
    ctl = chardev(tmp_path / "drv" / "dev" / "nvidiactl", 195, 255)
    plain = tmp_path / "drv" / "dev" / "nvidia-uvm"
    plain.touch()  # not a character device: no link
    links = tmp_path / "char"
    links.mkdir()
    (links / "195:255").symlink_to("/somewhere/else")  # udev's or the operator's: left alone
    made = CharLinks(str(links)).ensure(
        [
            DeviceFile("/dev/nvidia3", str(gpu)),
            DeviceFile("/dev/nvidiactl", str(ctl)),
            DeviceFile("/dev/nvidia-uvm", str(plain)),
        ]
    )
    assert made == [str(links / "195:3")]
    assert os.readlink(links / "195:3") == str(gpu)
    assert os.readlink(links / "195:255") == "/somewhere/else"
    assert sorted(os.listdir(links)) == ["195:255", "195:3"]
    assert CharLinks(str(links)).ensure([DeviceFile("/dev/nvidia3", str(gpu))]) == []  # once is enough


@needs_mknod
def test_a_link_that_cannot_be_made_is_said_once_and_refuses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = chardev(tmp_path / "dev" / "nvidia0", 195, 0)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # /dev/char cannot be made under a file
    links = CharLinks(str(blocked / "char"))
    with caplog.at_level(logging.WARNING):
        assert links.ensure([DeviceFile("/dev/nvidia0", str(gpu))]) == []
        assert links.ensure([DeviceFile("/dev/nvidia0", str(gpu))]) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "daemon-reload will take /dev/nvidia0 away" in warnings[0]
