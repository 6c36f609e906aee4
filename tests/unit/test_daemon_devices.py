"""Device IDs that name their GPU, and the kubelet's message limit."""

from __future__ import annotations

import dataclasses

import pytest

from gpushared.contract import MemoryUnit
from gpushared.core.node.devices import device_ids, device_list, gpu_of
from gpushared.daemon.devices import DeviceListTooLarge, check_message_size
from gpushared.kubelet.deviceplugin.server import list_message
from gpushared.kubelet.deviceplugin.v1beta1 import api_pb2
from tests.builders import inventory


def test_ids_are_short_and_name_their_gpu() -> None:
    ids = device_ids(3, 80)
    assert ids[0] == "3-0"
    assert ids[-1] == "3-79"
    assert {gpu_of(i) for i in ids} == {3}
    assert gpu_of("GPU-abc") is None
    assert gpu_of("3-x") is None


def test_device_list_carries_health_per_gpu() -> None:
    listed = device_list(inventory(2, 1), {1: False})
    assert [(d.id, d.healthy) for d in listed] == [("0-0", True), ("0-1", True), ("1-0", False)]


def test_devices_carry_their_gpus_numa_node_when_known() -> None:
    base = inventory(1, 1)
    placed = dataclasses.replace(base, gpus=(dataclasses.replace(base.gpus[0], numa=1), base.gpus[1]))
    assert [d.numa for d in device_list(placed, {})] == [1, None]
    message = list_message(device_list(placed, {}))
    assert [list(d.topology.nodes) for d in message.devices] == [[api_pb2.NUMANode(ID=1)], []]
    assert not message.devices[1].HasField("topology")


def test_gib_fits_and_mib_on_a_big_node_is_refused_naming_the_unit() -> None:
    check_message_size(inventory(*[80] * 8))
    check_message_size(inventory(16384, unit=MemoryUnit.MIB))
    with pytest.raises(DeviceListTooLarge, match="over the kubelet's 4 MiB limit: set memoryUnit: GiB"):
        check_message_size(inventory(*[81920] * 8, unit=MemoryUnit.MIB))
