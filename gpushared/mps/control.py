"""One NVIDIA MPS control daemon, for one GPU: start it, talk to it, find it again.

Everything goes through ``nvidia-cuda-mps-control``: started with ``-d`` it becomes the daemon; started
without arguments it is the client that sends one command line to the daemon named by
``CUDA_MPS_PIPE_DIRECTORY`` and prints the answer. Each GPU gets its own directory tree, so one daemon's
fault or restart never touches another GPU's clients:

    <root>/<GPU UUID>/pipe   the control socket; mounted into MPS pods
    <root>/<GPU UUID>/log    control.log and server.log
    <root>/<GPU UUID>/shm    a tmpfs that is /dev/shm for the daemon, its servers and its clients

That tmpfs is mounted in the host's mount namespace, where the kubelet finds it to mount into pods. Under
systemd, gpushared itself runs in a sandbox with a mount namespace of its own, so the unit mounts them
beforehand with ``gpushared mps prepare`` (a privileged ExecStartPre, which enters PID 1's namespace to
mount); daemons started from the sandbox then see those mounts through mount propagation.

The daemon runs in a mount namespace of its own where that tmpfs is ``/dev/shm``: its servers and the
pods' clients then share memory without the host's ``/dev/shm`` being exposed to any pod.

Driver 535 writes no pid file, so the daemon's pid is read from its control socket (SO_PEERCRED).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CONTROL_SOCKET = "control"
STOPPED_MARKER = "stopped"


class MpsError(Exception):
    pass


@dataclass(frozen=True)
class GpuDirs:
    """The directories of one GPU's daemon."""

    base: Path

    @classmethod
    def of(cls, root: Path, uuid: str) -> GpuDirs:
        return cls(root / uuid)

    @property
    def pipe(self) -> Path:
        return self.base / "pipe"

    @property
    def log(self) -> Path:
        return self.base / "log"

    @property
    def shm(self) -> Path:
        return self.base / "shm"

    @property
    def stopped(self) -> Path:
        """Present while an operator has stopped this daemon (`gpushared mps stop`): do not restart it."""
        return self.base / STOPPED_MARKER


class MpsControl:
    def __init__(
        self, *, binary: str, uuid: str, dirs: GpuDirs, timeout: float = 5.0, library_path: str | None = None
    ) -> None:
        self.binary = binary
        self.uuid = uuid
        self.dirs = dirs
        self.timeout = timeout
        #: the driver root's library directory (config driverRoot): where the MPS server finds libcuda
        self.library_path = library_path

    def env(self) -> dict[str, str]:
        return {
            # The daemon then sees this one GPU as device 0, whatever its index on the node.
            "CUDA_VISIBLE_DEVICES": self.uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.dirs.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.dirs.log),
            **({"LD_LIBRARY_PATH": self.library_path} if self.library_path else {}),
        }

    # --- start and stop -----------------------------------------------------------------------------------

    def prepare(self, *, shm_size: str, host: Path | None = None) -> bool:
        """Make the directories and mount the shm tmpfs (unless it is); whether it mounted one.

        The mount must be made in the kubelet's mount namespace, or the kubelet mounts an empty directory
        into MPS pods and their clients never meet the daemon's servers. ``host`` is the mount namespace to
        make it in (``/proc/1/ns/mnt``) when that is not this process's own."""
        for path in (self.dirs.pipe, self.dirs.log, self.dirs.shm):
            path.mkdir(parents=True, exist_ok=True)
        if _is_mountpoint(self.dirs.shm, mountinfo=Path("/proc/1/mountinfo") if host else MOUNTINFO):
            return False
        enter = ["nsenter", f"--mount={host}", "--"] if host else []
        options = f"size={shm_size},mode=1777,nosuid,nodev"
        _run([*enter, "mount", "-t", "tmpfs", "-o", options, "tmpfs", str(self.dirs.shm)])
        return True

    def start(self, *, shm_size: str, multiuser: bool) -> int:
        """Start the daemon in its own mount namespace; returns its pid once its control socket answers."""
        if not _is_mountpoint(self.dirs.shm) and mounts_stay_private(self.dirs.shm):
            raise MpsError(
                f"{self.dirs.shm} is not mounted, and a mount made here would be hidden from the kubelet: this "
                "process runs in a mount namespace of its own (systemd's sandbox). `gpushared mps prepare` mounts "
                "it for the whole host; the unit runs it before each start: systemctl restart gpushared"
            )
        self.prepare(shm_size=shm_size)
        for stale in self.dirs.pipe.iterdir():  # a dead daemon's sockets make the new one refuse to start
            stale.unlink()
        script = 'mount --bind "$1" /dev/shm && shift && exec "$@"'
        argv = [self.binary, "-d", *(["-M"] if multiuser else [])]
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **self.env()}
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(self.dirs.shm), *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=self.timeout,
            check=False,
        )
        if result.returncode != 0:
            raise MpsError(f"{self.binary} -d failed ({result.returncode}): {(result.stderr or result.stdout).strip()}")
        deadline = time.monotonic() + self.timeout
        while (pid := self.pid()) is None:
            if time.monotonic() > deadline:
                raise MpsError(f"the daemon did not open {self.dirs.pipe / CONTROL_SOCKET} in {self.timeout:.0f} s")
            time.sleep(0.05)
        return pid

    def quit(self) -> None:
        """Ask the daemon to exit (its servers' clients are cut off) and wait until it has."""
        pid = self.pid()
        if pid is None:
            return
        self.command("quit")
        if not _wait_gone(pid, self.timeout):
            raise MpsError(f"MPS control daemon {pid} did not exit after quit")

    def kill(self, pid: int) -> None:
        """For a daemon that no longer answers."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        _wait_gone(pid, self.timeout)

    def release_shm(self) -> None:
        """Unmount the shm tmpfs if it is mounted. The supervisor and an operator's `gpushared mps stop` can
        release it at the same moment: an unmount that fails because the other one got there first is done."""
        if not _is_mountpoint(self.dirs.shm):
            return
        try:
            _run(["umount", str(self.dirs.shm)])
        except MpsError:
            if _is_mountpoint(self.dirs.shm):
                raise

    # --- talking to it ------------------------------------------------------------------------------------

    def command(self, line: str) -> str:
        """One control command; its answer. A daemon that does not answer in time counts as hung."""
        verb = line.split(maxsplit=1)[0]
        try:
            result = subprocess.run(
                [self.binary],
                input=line + "\n",
                env={**os.environ, **self.env()},
                capture_output=True,
                text=True,
                timeout=self.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise MpsError(f"no answer to {verb!r} in {self.timeout:.0f} s: the daemon hangs") from None
        except OSError as exc:
            raise MpsError(f"cannot run {self.binary}: {exc}") from None
        answer = (result.stdout + result.stderr).strip()
        if result.returncode != 0 or answer.startswith(("Cannot find", "Unknown command")):
            raise MpsError(f"{verb}: {answer or f'exit {result.returncode}'}")
        return answer

    def pid(self) -> int | None:
        """The pid listening on the control socket, or None when nothing does."""
        path = self.dirs.pipe / CONTROL_SOCKET
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            probe.settimeout(self.timeout)
            try:
                probe.connect(str(path))
                raw = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            except OSError:
                return None
        pid = int(struct.unpack("3i", raw)[0])
        return pid if pid > 0 else None

    def servers(self) -> list[int]:
        return [int(word) for word in self.command("get_server_list").split() if word.isdigit()]

    def clients(self, server: int) -> list[int]:
        return [int(word) for word in self.command(f"get_client_list {server}").split() if word.isdigit()]

    def supports_multiuser(self) -> bool:
        """Whether this driver's daemon has ``-M`` (one server for every UID); 535 does not."""
        try:
            result = subprocess.run([self.binary, "-h"], capture_output=True, text=True, timeout=5, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        text = result.stdout + result.stderr
        return "-M" in text.split() or "multiuser" in text.lower() or "multi-user" in text.lower()


def mounts_stay_private(path: Path) -> bool:
    """Whether a mount made at ``path`` stays in this process's mount namespace: the mount holding it is a
    slave (it receives the host's mounts, sends none back), as in systemd's sandbox for a unit."""
    holder: list[str] = []
    target = str(path)
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[4]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(holder[4] if holder else ""):
                holder = fields
    optional = holder[6 : holder.index("-")] if holder else []
    return any(f.startswith("master:") for f in optional) and not any(f.startswith("shared:") for f in optional)


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise MpsError(f"{' '.join(argv)}: {result.stderr.strip()}")


MOUNTINFO = Path("/proc/self/mountinfo")


def host_mount_namespace() -> Path | None:
    """PID 1's mount namespace when it is not ours and we may enter it: where a privileged helper such as
    the unit's ExecStartPre (which systemd still runs in a namespace of its own) must mount for the host."""
    init = Path("/proc/1/ns/mnt")
    try:
        ours, theirs = os.stat("/proc/self/ns/mnt"), os.stat(init)
    except OSError:
        return None
    return None if (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino) else init


def _is_mountpoint(path: Path, *, mountinfo: Path = MOUNTINFO) -> bool:
    target = str(path)
    with mountinfo.open() as mounts:
        return any(line.split()[4] == target for line in mounts if len(line.split()) > 4)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting for a parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
