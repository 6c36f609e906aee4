"""The device plugin's ListAndWatch stream: it sends a change at once, and ends at once when the kubelet hangs
up or the server stops, without waking on a timer while nothing happens (an idle node's CPU)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpushared.core.node.devices import Device
from gpushared.kubelet.deviceplugin import server as plugin_server
from gpushared.kubelet.deviceplugin.server import PluginServer
from gpushared.kubelet.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

PROMPT = 2.0  # well under the stream's safety-net timeout, which the tests raise further still


class Devices:
    """The DeviceManager side the stream reads: a device list with a version, and the wake-ups."""

    resource_name = "aliyun.com/gpu-mem"

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._version = 1
        self._devices = [Device(id=f"0-{i}", healthy=True) for i in range(4)]
        self.waits = 0
        #: the timeout of each wait: how long the stream would sleep if nothing woke it
        self.timeouts: list[float] = []

    def devices(self) -> tuple[int, list[Device]]:
        with self._lock:
            return self._version, list(self._devices)

    def wait_for_change(self, version: int, timeout: float) -> None:
        with self._lock:
            self.waits += 1
            self.timeouts.append(timeout)
            if self._version == version:
                self._lock.wait(timeout)

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def set_health(self, healthy: bool) -> None:
        with self._lock:
            self._devices = [Device(id=d.id, healthy=healthy) for d in self._devices]
            self._version += 1
            self._lock.notify_all()

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        raise NotImplementedError

    def allocate(self, device_ids: Sequence[str]) -> object:
        raise NotImplementedError


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PluginServer, Devices]]:
    # Long enough that only a wake-up, never the timer, can end a wait within the test.
    monkeypatch.setattr(plugin_server, "WATCH_RECHECK_SECONDS", 600.0)
    devices = Devices()
    server = PluginServer(devices, plugin_dir=tmp_path, endpoint="gpushared.sock")  # type: ignore[arg-type]
    server.start()
    try:
        yield server, devices
    finally:
        server.stop()


def _stream(server: PluginServer) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(f"unix://{server.socket}")
    return channel, api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())


def _until(condition: object, seconds: float = PROMPT) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < seconds, "not within the time"
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_change_is_sent_at_once(served: tuple[PluginServer, Devices]) -> None:
    server, devices = served
    channel, stream = _stream(server)
    with channel:
        assert all(d.health == "Healthy" for d in next(stream).devices)
        devices.set_health(False)
        started = time.monotonic()
        assert all(d.health == "Unhealthy" for d in next(stream).devices)
        assert time.monotonic() - started < PROMPT


def test_the_stream_ends_at_once_when_the_kubelet_hangs_up(served: tuple[PluginServer, Devices]) -> None:
    server, _ = served
    channel, stream = _stream(server)
    next(stream)
    _until(lambda: server.watched)
    stream.cancel()
    channel.close()
    _until(lambda: not server.watched)


def test_the_stream_ends_at_once_when_the_server_stops(served: tuple[PluginServer, Devices]) -> None:
    server, _ = served
    channel, stream = _stream(server)
    with channel:
        next(stream)
        _until(lambda: server.watched)
        started = time.monotonic()
        server.stop()
        assert list(stream) == []  # ended (the kubelet dials again when the plugin registers again)
        assert time.monotonic() - started < PROMPT
        assert not server.watched


def test_an_idle_stream_does_not_wake(served: tuple[PluginServer, Devices]) -> None:
    """It waits for a change, or for the safety net's timeout, and for nothing shorter: the stream used to
    look every second. The wait's own timeout says so, without waiting a second to see nothing happen."""
    server, devices = served
    channel, stream = _stream(server)
    with channel:
        next(stream)
        _until(lambda: devices.waits >= 1)
        assert devices.timeouts == [plugin_server.WATCH_RECHECK_SECONDS]
