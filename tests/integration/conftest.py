"""The node-daemon world: fake API server with a Node, fake kubelet, fake NVML (4 GPUs), systemd socket."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.extender_harness import Extender, gpushared_cluster
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.kubelet import FakeKubelet
from tests.fakes.nvml import FakeNvml
from tests.fakes.systemd import NotifySocket
from tests.harness import Daemon, node_body

#: Four GPUs of different sizes, MiB: 16, 12, 24 and 8 GiB.
SIZES = (16384, 12288, 24576, 8192)


@pytest.fixture
def daemon(kubelet_root: Path, plugin_dir: Path, fake_nvml_library: Path, tmp_path: Path) -> Iterator[Daemon]:
    with FakeApiServer() as api, FakeKubelet(kubelet_root, seed=1) as kubelet:
        api.create(node_body())
        notify = NotifySocket(kubelet_root / "notify.sock")
        nvml = FakeNvml.with_sizes(tmp_path / "nvml.json", fake_nvml_library, *SIZES)
        world = Daemon(api=api, kubelet=kubelet, nvml=nvml, notify=notify, workdir=tmp_path)
        yield world
        if world.process is not None and world.process.poll() is None:
            world.stop()
        notify.close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    """A fake API server holding gpushared's cluster (the extender's world); a module may define its own."""
    with FakeApiServer() as server:
        gpushared_cluster(server)
        yield server


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Extender]]:
    """Start extender processes that are killed after the test, whatever happened in it."""
    started: list[Extender] = []

    def make(api: FakeApiServer, **kwargs: object) -> Extender:
        extender = Extender(api=api, workdir=tmp_path, **kwargs).start()  # type: ignore[arg-type]
        started.append(extender)
        return extender

    yield make
    for extender in started:
        if extender.process is not None and extender.process.poll() is None:
            extender.process.kill()
            extender.process.wait()


@pytest.fixture
def extender(api: FakeApiServer, spawn: Callable[..., Extender]) -> Iterator[Extender]:
    """An extender process on the module's ``api`` fixture, ready, with the default policy (fgd)."""
    ext = spawn(api)
    ext.wait_ready()
    yield ext
    ext.stop()


@pytest.fixture
def binpack_extender(api: FakeApiServer, spawn: Callable[..., Extender]) -> Iterator[Extender]:
    """The same with ``--policy binpack``: for what is held to best fit, Aliyun's choice within a node."""
    ext = spawn(api, args=["--policy", "binpack"])
    ext.wait_ready()
    yield ext
    ext.stop()
