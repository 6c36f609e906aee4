"""The node's NVIDIA device files, for ``deviceNodes``: which exist, and their ``/dev/char`` links.

Under the systemd cgroup driver, runc records each device a container may open in the systemd scope's
``DeviceAllow=``, and ``systemctl daemon-reload`` rewrites the scope's device rules from that record. runc
names a character device to systemd as ``/dev/char/<major>:<minor>`` and leaves out any device for which
neither that link nor ``/sys/dev/char/<major>:<minor>`` exists (runc issue 3708). The NVIDIA driver creates
neither for its files, so a GPU handed over as a device spec would still be lost at the next reload: the
daemon makes the links, for the files it hands over, as ``nvidia-ctk system create-dev-char-symlinks`` does.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Sequence

from gpushared.core.node.exposure import CONTROL_DEVICES, DeviceFile, ExposurePolicy, gpu_device_path

log = logging.getLogger(__name__)

#: where runc and systemd look for a character device by number (udev's directory)
CHAR_LINKS_DIR = "/dev/char"


def present_devices(policy: ExposurePolicy, minors: Iterable[int | None]) -> list[str]:
    """Which of the GPUs' files and the control devices exist under the policy's dev root, as container paths."""
    wanted = [gpu_device_path(minor) for minor in minors if minor is not None] + list(CONTROL_DEVICES)
    return [path for path in wanted if os.path.exists(os.path.join(policy.dev_root, path.lstrip("/")))]


class CharLinks:
    """Makes ``/dev/char/<major>:<minor>`` point at each character device a container is handed.

    A link that exists is left alone (udev's, the operator's, or ours from before); a file that is not a
    character device (the tests' stand-ins) needs none. Failing to make one does not refuse the container:
    it gets its GPU, only not safe from a reload, and the daemon says so once per device.
    """

    def __init__(self, directory: str = CHAR_LINKS_DIR) -> None:
        self.directory = directory
        self._warned: set[str] = set()

    def ensure(self, files: Sequence[DeviceFile]) -> list[str]:
        """Make the missing links for ``files``; returns those made."""
        made: list[str] = []
        for file in files:
            try:
                info = os.stat(file.host_path)
            except OSError:
                continue  # gone since the check; the runtime will say so
            if not stat.S_ISCHR(info.st_mode):
                continue
            link = os.path.join(self.directory, f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}")
            if os.path.lexists(link):
                continue
            try:
                os.makedirs(self.directory, exist_ok=True)
                os.symlink(file.host_path, link)
            except FileExistsError:
                continue  # made by another at the same moment
            except OSError as exc:
                if link not in self._warned:
                    self._warned.add(link)
                    log.warning(
                        "cannot link %s -> %s (%s): under the systemd cgroup driver, systemctl daemon-reload "
                        "will take %s away from containers that have it",
                        link,
                        file.host_path,
                        exc.strerror,
                        file.container_path,
                    )
                continue
            log.info("linked %s -> %s so runc records the device for systemd", link, file.host_path)
            made.append(link)
        return made
