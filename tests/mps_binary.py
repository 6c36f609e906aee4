"""The real ``nvidia-cuda-mps-control`` from Debian's non-free ``nvidia-cuda-mps``, unpacked, not installed.

Its control protocol works without a GPU (the servers it would start cannot), which is all the daemon's
supervision needs: start, probe, defaults, read-back, quit. ``GPUSHARED_MPS_CONTROL`` names another binary.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

PACKAGE = "nvidia-cuda-mps"
SOURCE = "deb http://deb.debian.org/debian bookworm non-free"


def fetch_mps_control(dest: Path) -> Path:
    """Download and unpack the package into ``dest`` (once); the control binary's path."""
    if os.environ.get("GPUSHARED_MPS_CONTROL"):
        return Path(os.environ["GPUSHARED_MPS_CONTROL"])
    binary = dest / "root" / "usr" / "bin" / "nvidia-cuda-mps-control"
    if binary.exists():
        return binary
    (dest / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (dest / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    (dest / "sources.list").write_text(SOURCE + "\n")
    apt = [
        "apt-get",
        "-q",
        "-o", f"Dir::Etc::sourcelist={dest / 'sources.list'}",
        "-o", "Dir::Etc::sourceparts=-",
        "-o", f"Dir::State::Lists={dest / 'lists'}",
        "-o", f"Dir::Cache::archives={dest / 'archives'}",
    ]  # fmt: skip
    subprocess.run([*apt, "update"], check=True, capture_output=True)
    subprocess.run([*apt, "download", PACKAGE], check=True, capture_output=True, cwd=dest)
    [deb] = dest.glob(f"{PACKAGE}_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest / "root")], check=True)
    return binary
