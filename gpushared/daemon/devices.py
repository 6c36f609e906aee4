"""The kubelet's message limit on the device list (the IDs themselves are core.node.devices)."""

from __future__ import annotations

from gpushared.contract import GpuInventory
from gpushared.core.node.devices import device_list
from gpushared.kubelet.deviceplugin.server import MAX_MESSAGE_BYTES, list_message


class DeviceListTooLarge(Exception):
    pass


def check_message_size(inventory: GpuInventory) -> None:
    """Refuse a device list the kubelet would drop ("received message larger than max")."""
    size = list_message(device_list(inventory, {})).ByteSize()
    if size > MAX_MESSAGE_BYTES - 64 * 1024:
        raise DeviceListTooLarge(
            f"{inventory.total} {inventory.unit.value} devices make a {size / 2**20:.1f} MiB ListAndWatch message, "
            f"over the kubelet's 4 MiB limit: set memoryUnit: GiB"
        )
