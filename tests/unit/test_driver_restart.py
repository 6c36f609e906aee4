"""The daemon under systemd asks to be started again when the driver registers its devices after it did."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushared.daemon import gpus as gpus_module
from gpushared.daemon.config import load
from gpushared.daemon.errors import RestartNeeded
from gpushared.daemon.service import Service
from gpushared.nvml.backend import GpuBackendError


class NoNvml:
    """NVML as the unit's device cgroup leaves it when the driver's devices are not in the allow-list."""

    def start(self) -> None:
        raise GpuBackendError("NVML could not start: Insufficient Permissions")

    def stop(self) -> None:
        pass


@pytest.mark.parametrize(
    ("systemd", "groups", "restart"),
    [
        (True, (frozenset(), frozenset({"nvidia", "nvidia-uvm"})), True),
        (True, (frozenset(), frozenset()), False),  # no driver yet: wait, as before
        (True, (frozenset({"nvidia-frontend"}), frozenset({"nvidia-frontend"})), False),  # another NVML failure
        (False, (frozenset(), frozenset({"nvidia"})), False),  # not under systemd: nobody would start it again
    ],
)
def test_restart_when_the_driver_came_after_the_unit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    systemd: bool,
    groups: tuple[frozenset[str], frozenset[str]],
    restart: bool,
) -> None:
    """``groups``: the NVIDIA device groups in /proc/devices when the daemon started, and now."""
    if systemd:
        monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    else:
        monkeypatch.delenv("INVOCATION_ID", raising=False)
    seen = iter(groups)
    monkeypatch.setattr(gpus_module.driver, "loaded_device_groups", lambda: next(seen))
    service = Service(load(tmp_path / "none.yaml", env={}), backend=NoNvml())  # type: ignore[arg-type]
    if restart:
        with pytest.raises(RestartNeeded, match="registered its devices after gpushared started"):
            service.gpus.read()
    else:
        service.gpus.read()  # logged, every GPU unhealthy, waiting
        assert not service.gpus.ok
