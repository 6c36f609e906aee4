"""Container images for the local cluster without a registry: one-layer archives in ``docker save`` format,
which ``ctr images import`` reads (the pause container, busybox, one static binary)."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

from tests.e2e.layout import BUSYBOX_IMAGE, PAUSE_IMAGE

PAUSE_SOURCE = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGINT, stop);
    signal(SIGTERM, stop);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


def _docker_archive(path: Path, tag: str, files: dict[str, tuple[bytes | str, int]], cmd: list[str]) -> Path:
    """A one-layer image in ``docker save`` format, which ``ctr images import`` reads.

    ``files`` maps a path in the image to its content (bytes) or a symlink target (str), with its mode.
    """
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        dirs = sorted({str(Path(name).parent) for name in files} - {"."} | {"tmp", "etc", "proc", "sys", "dev"})
        for directory in dirs:
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        for name, (content, mode) in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.mode = mode
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": cmd, "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(path, "w") as archive:
        for name, data in (("layer.tar", layer_bytes), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def build_pause_image(out: Path) -> Path:
    source = out / "pause.c"
    source.write_text(PAUSE_SOURCE)
    subprocess.run(["gcc", "-static", "-O2", "-o", out / "pause", source], check=True, capture_output=True)
    binary = (out / "pause").read_bytes()
    return _docker_archive(out / "pause.tar", PAUSE_IMAGE, {"pause": (binary, 0o755)}, ["/pause"])


def build_busybox_image(out: Path, busybox: Path) -> Path:
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    files: dict[str, tuple[bytes | str, int]] = {"bin/busybox": (busybox.read_bytes(), 0o755)}
    files.update({f"bin/{applet}": ("busybox", 0o777) for applet in applets if applet != "busybox"})
    return _docker_archive(out / "busybox.tar", BUSYBOX_IMAGE, files, ["sh"])


def build_binary_image(out: Path, binary: Path, tag: str) -> Path:
    """An image of one static binary at /bin, its entry point: upstream's kube-scheduler image, made here
    from the cached build without a registry."""
    files: dict[str, tuple[bytes | str, int]] = {f"bin/{binary.name}": (binary.read_bytes(), 0o755)}
    return _docker_archive(out / f"{binary.name}.tar", tag, files, [f"/bin/{binary.name}"])
