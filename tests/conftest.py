"""Fixtures shared by every test: the fakes at the boundaries we cannot have (GPU, API server, kubelet)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.nvml import FakeNvml, build_library
from tests.mps_binary import fetch_mps_control


@pytest.fixture(scope="session")
def fake_nvml_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_library(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def fake_nvml(fake_nvml_library: Path, tmp_path: Path) -> Iterator[FakeNvml]:
    """Four GPUs of different sizes, loaded into this process for the real pynvml."""
    nvml = FakeNvml.with_sizes(tmp_path / "nvml.json", fake_nvml_library, 16384, 12288, 24576, 8192)
    previous = os.environ.get("FAKE_NVML_CONFIG")
    nvml.preload()
    yield nvml
    if previous is None:
        os.environ.pop("FAKE_NVML_CONFIG", None)
    else:
        os.environ["FAKE_NVML_CONFIG"] = previous


@pytest.fixture
def kubelet_root() -> Iterator[Path]:
    """Plays /var/lib/kubelet. Short, because a unix socket path has at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gps-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugin_dir(kubelet_root: Path) -> Path:
    path = kubelet_root / "device-plugins"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def mps_control(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real nvidia-cuda-mps-control, fetched from Debian non-free once per session."""
    return fetch_mps_control(tmp_path_factory.mktemp("nvidia-cuda-mps"))
