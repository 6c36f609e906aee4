"""What kubelet and containerd leave on the machine, found and undone: pod processes and their cgroups,
containerd's shims, mounts under the cluster's directories, the MPS control daemons. The local cluster's
tear-down (``LocalCluster.down``) and its check for leftovers use these."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import psutil

from tests.e2e.layout import ClusterError


def kubepods_cgroups() -> list[Path]:
    found: list[Path] = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        for top in (hierarchy / "kubepods", hierarchy / "kubepods.slice"):
            if top.is_dir():
                found.extend(p for p in [top, *top.rglob("*")] if p.is_dir())
    return found


def cgroup_pids(cgroup: Path) -> list[int]:
    try:
        return [int(line) for line in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def container_pids(container_id: str) -> list[int]:
    """The host PIDs of a container's processes, from their cgroups, lowest (its first process) first."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if container_id in (entry / "cgroup").read_text():
                    found.append(int(entry.name))
    return sorted(found)


def mps_daemons(mps_root: Path) -> list[psutil.Process]:
    """The MPS control daemons whose pipe directory is under ``mps_root``."""
    found = []
    for process in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            pipe = process.environ().get("CUDA_MPS_PIPE_DIRECTORY", "") if "mps" in process.info["name"] else ""
            if pipe.startswith(str(mps_root)):
                found.append(process)
    return found


def kill_shims(containerd_socket: Path) -> None:
    """containerd's shims re-parent themselves away from containerd; they name its socket on their command line."""
    marker = str(containerd_socket)
    for process in psutil.process_iter(["cmdline"]):
        if marker in (process.info["cmdline"] or []) and "containerd-shim" in " ".join(process.info["cmdline"]):
            process.kill()


def kill_pod_processes() -> None:
    for cgroup in kubepods_cgroups():
        for pid in cgroup_pids(cgroup):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def unmount(roots: tuple[str, ...]) -> None:
    """Every mount at or under ``roots``, deepest first (lazily where a plain unmount is refused)."""
    mounts = [
        line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines() if len(line.split()) > 4
    ]
    ours = [m for m in mounts if any(m == r or m.startswith(r + "/") for r in roots)]
    for mount in sorted(ours, key=lambda m: m.count("/"), reverse=True):
        if subprocess.run(["umount", mount], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)


def remove_cgroups() -> None:
    for _ in range(20):
        remaining = kubepods_cgroups()
        if not remaining:
            return
        for cgroup in sorted(remaining, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                cgroup.rmdir()
        time.sleep(0.1)
    raise ClusterError(f"cgroups left behind: {', '.join(map(str, kubepods_cgroups()))}")


def leftovers(state: Path, mps_root: Path) -> list[str]:
    """Anything still running that a cluster in ``state`` started: a process naming its state directory, a
    process in a pod's cgroup, an MPS control daemon under ``mps_root``."""
    found = [
        f"{p.pid} {' '.join(p.info['cmdline'])[:120]}"
        for p in psutil.process_iter(["cmdline"])
        if p.pid != os.getpid() and any(str(state) in arg for arg in p.info["cmdline"] or [])
    ]
    found += [f"{pid} in {cgroup}" for cgroup in kubepods_cgroups() for pid in cgroup_pids(cgroup)]
    found += [f"{p.pid} MPS control daemon" for p in mps_daemons(mps_root)]
    return found
