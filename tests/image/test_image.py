"""The extender image, run under containerd's ``ctr`` as a host-network container against the fake API
server: it starts, syncs and answers. Needs root, containerd and ``make image`` first (``make image-test``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpushared import __version__
from tests.extender_harness import Extender, gpu_node
from tests.fakes.apiserver import FakeApiServer
from tests.harness import free_port, wait_until

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
ARCHIVE = ROOT / "dist" / f"gpushared-extender_{__version__}.tar"
IMAGE = f"localhost/gpushared-extender:{__version__}"


@pytest.fixture
def containerd() -> Iterator[list[str]]:
    if os.geteuid() != 0 or shutil.which("containerd") is None:
        pytest.fail("the image test needs root and containerd (apt-get install containerd)")
    if not ARCHIVE.exists():
        pytest.fail(f"{ARCHIVE} is missing: run `make image` first")
    work = Path(tempfile.mkdtemp(prefix="gps-ctr-"))
    socket = work / "containerd.sock"
    (work / "config.toml").write_text(
        f'version = 2\nroot = "{work}/root"\nstate = "{work}/state"\n'
        f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "{socket}"\n'
    )
    daemon = subprocess.Popen(
        ["containerd", "--config", str(work / "config.toml")],
        stdout=(work / "containerd.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    ctr = ["ctr", "--address", str(socket), "--namespace", "gpushared-test"]
    try:
        wait_until(
            lambda: subprocess.run([*ctr, "version"], capture_output=True, check=False).returncode == 0, timeout=30
        )
        subprocess.run([*ctr, "images", "import", str(ARCHIVE)], check=True, capture_output=True)
        yield ctr
    finally:
        subprocess.run(
            [*ctr, "tasks", "kill", "-s", "SIGKILL", "extender-image-test"], capture_output=True, check=False
        )
        time.sleep(0.5)
        subprocess.run([*ctr, "containers", "rm", "extender-image-test"], capture_output=True, check=False)
        daemon.terminate()
        daemon.wait(15)
        subprocess.run(["umount", "-R", str(work / "state")], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)


def test_the_image_serves_the_extender(containerd: list[str], tmp_path: Path) -> None:
    with FakeApiServer() as api:
        api.create(gpu_node("n1", 16))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
        kubeconfig.chmod(0o644)
        port = free_port()
        run = subprocess.Popen(
            [
                *containerd,
                "run",
                "--rm",
                "--net-host",
                "--mount",
                f"type=bind,src={kubeconfig},dst=/etc/gpushared/kubeconfig,options=rbind:ro",
                IMAGE,
                "extender-image-test",
                "/opt/gpushared/bin/gpushared-extender",
                "--kubeconfig",
                "/etc/gpushared/kubeconfig",
                "--address",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=(tmp_path / "container.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        client = Extender(api=api, workdir=tmp_path, port=port)
        try:
            wait_until(
                lambda: client.get("/healthz")[0] == 200, timeout=60, message=(tmp_path / "container.log").read_text()
            )
            client.wait_ready()
            assert client.get("/version") == (200, f"{__version__}\n".encode())
            status, result = client.filter(
                api.create(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": "p", "namespace": "default"},
                        "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "4"}}}]},
                    }
                ),
                "n1",
            )
            assert (status, result["NodeNames"]) == (200, ["n1"])
        finally:
            subprocess.run([*containerd, "tasks", "kill", "extender-image-test"], capture_output=True, check=False)
            run.wait(30)
