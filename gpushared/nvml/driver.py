"""Where the NVIDIA driver's user-space files are: the host's root, or a driver container's.

The GPU Operator installs the driver in a container and exposes its root at ``/run/nvidia/driver`` on the
host; the node's own ``/usr/lib`` then has no ``libnvidia-ml.so.1`` and ``/usr/bin`` no
``nvidia-cuda-mps-control``. Config ``driverRoot`` names that root; ``/`` (the default) is a driver
installed on the host, found the usual way (the dynamic linker, ``PATH``).
"""

from __future__ import annotations

import os
from pathlib import Path

#: Library directories of the distributions the driver container images are built on.
LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib64",
)
NVML_LIBRARY = "libnvidia-ml.so.1"


def on_host(root: str) -> bool:
    return os.path.normpath(root) == "/"


def library_dir(root: str) -> str | None:
    """The directory under ``root`` holding NVML's library (and libcuda beside it); None on the host root."""
    if on_host(root):
        return None
    for directory in LIBRARY_DIRS:
        if os.path.exists(os.path.join(root, directory, NVML_LIBRARY)):
            return os.path.join(root, directory)
    return None


def binary(root: str, name: str) -> str:
    """A driver program (``nvidia-cuda-mps-control``) under the driver root; a path is taken as it is."""
    if on_host(root) or "/" in name:
        return name
    for directory in ("usr/bin", "usr/local/bin", "bin"):
        candidate = os.path.join(root, directory, name)
        if os.path.exists(candidate):
            return candidate
    return os.path.join(root, "usr/bin", name)


def device_groups(proc_devices: str) -> frozenset[str]:
    """The NVIDIA character device groups in ``/proc/devices`` text: ``nvidia`` or ``nvidia-frontend`` (major
    195, named by how the module was built), ``nvidia-uvm``, ``nvidia-caps``, ``nvidia-nvlink``... The unit's
    ``DeviceAllow=char-nvidia*`` matches exactly these, as systemd resolves them when the unit starts."""
    groups: set[str] = set()
    section = ""
    for line in proc_devices.splitlines():
        if line.endswith(":"):
            section = line
            continue
        parts = line.split()
        if section.startswith("Character") and len(parts) == 2 and parts[1].startswith("nvidia"):
            groups.add(parts[1])
    return frozenset(groups)


def loaded_device_groups(path: Path = Path("/proc/devices")) -> frozenset[str]:
    try:
        return device_groups(path.read_text())
    except OSError:
        return frozenset()


def loaded_after_start(at_start: frozenset[str], now: frozenset[str]) -> bool:
    """The driver registered its devices after the unit started (a GPU Operator driver container loads it
    late): systemd resolved ``char-nvidia*`` to nothing then, so the unit's device cgroup denies every GPU
    until the unit starts again."""
    return not at_start and bool(now)
