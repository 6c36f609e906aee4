"""The GPUs' used memory on the node's inventory annotation: carried, throttled, and read without churn."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gpushared import contract
from gpushared.contract import DEFAULT_RESOURCES, GpuInventory, MemoryUnit
from gpushared.daemon.node import NodePublisher
from gpushared.extender.cache import ClusterCache
from tests.builders import inventory

INV = inventory(16, 16)


class Patches:
    """The API client, as far as the publisher uses it: every patch of the node's status, kept."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def get_node(self, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}}

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(patch)
        return {}

    def used(self) -> list[dict[int, int | None]]:
        """Per patch that carried the inventory: GPU index -> usedMiB."""
        return [
            {
                g.index: g.used_mib
                for g in contract.parse_inventory(p["metadata"]["annotations"][contract.NODE_INVENTORY]).gpus
            }
            for p in self.sent
            if "metadata" in p
        ]


def publisher(now: list[float]) -> tuple[NodePublisher, Patches]:
    api = Patches()
    node = NodePublisher(api, "n1", resources=DEFAULT_RESOURCES, usage_seconds=60, clock=lambda: now[0])  # type: ignore[arg-type]
    node.check()
    return node, api


def test_use_goes_out_at_most_once_a_minute_and_only_when_it_moved_by_more_than_a_unit() -> None:
    now = [0.0]
    node, api = publisher(now)
    node.publish(INV, usage={0: 3000, 1: 0})
    assert api.used() == [{0: 3000, 1: 0}]
    now[0] = 30
    node.publish(INV, usage={0: 9000, 1: 0})  # moved, but within the minute
    now[0] = 61
    node.publish(INV, usage={0: 3900, 1: 1000})  # a minute on, but no GPU moved by more than 1 GiB
    assert api.used() == [{0: 3000, 1: 0}]
    node.publish(INV, usage={0: 4200, 1: 0})
    assert api.used() == [{0: 3000, 1: 0}, {0: 4200, 1: 0}]


def test_a_change_of_the_gpus_goes_out_at_once_with_the_use_last_written() -> None:
    now = [0.0]
    node, api = publisher(now)
    node.publish(INV, usage={0: 3000, 1: 0})
    sick = GpuInventory(unit=INV.unit, gpus=(INV.gpus[0], dataclasses.replace(INV.gpus[1], healthy=False)))
    now[0] = 5
    node.publish(sick, usage={0: 12000, 1: 0})
    assert api.used() == [{0: 3000, 1: 0}, {0: 3000, 1: 0}]
    assert [
        g["healthy"] for g in json.loads(api.sent[-1]["metadata"]["annotations"][contract.NODE_INVENTORY])["gpus"]
    ] == [True, False]


def test_without_a_watcher_no_use_is_written() -> None:
    node, api = publisher([0.0])
    node.publish(INV)
    assert api.used() == [{0: None, 1: None}]
    assert "usedMiB" not in api.sent[0]["metadata"]["annotations"][contract.NODE_INVENTORY]


def test_use_is_not_part_of_a_gpus_identity() -> None:
    used = GpuInventory(unit=INV.unit, gpus=tuple(dataclasses.replace(g, used_mib=100) for g in INV.gpus))
    assert used == INV
    assert contract.parse_inventory(contract.format_inventory(used)).gpus[0].used_mib == 100
    older = contract.format_inventory(INV)  # what a daemon before this wrote
    assert contract.parse_inventory(older).gpus[0].used_mib is None


def test_the_extender_keeps_its_ledger_when_only_use_changed() -> None:
    cache = ClusterCache(list_nodes=lambda **_: None, list_pods=lambda **_: None, resources=DEFAULT_RESOURCES)

    def node(used: int) -> dict[str, Any]:
        gpus = tuple(dataclasses.replace(g, used_mib=used) for g in INV.gpus)
        text = contract.format_inventory(GpuInventory(unit=MemoryUnit.GIB, gpus=gpus))
        return {"metadata": {"name": "n1", "annotations": {contract.NODE_INVENTORY: text}}, "status": {}}

    cache.state.on_node(None, node(100))  # type: ignore[arg-type]
    ledger = cache.state.nodes["n1"].ledger
    assert ledger is not None
    version = ledger.version
    cache.state.on_node(node(100), node(7000))  # type: ignore[arg-type]
    assert cache.state.nodes["n1"].ledger is ledger and ledger.version == version
    snapshot = cache.state.snapshot("n1")
    assert snapshot is not None and snapshot[0].gpus[0].used_mib == 7000


def test_inspect_details_show_use_beside_allocation() -> None:
    from gpushared.core.placement.report import node_report
    from gpushared.core.shared.ledger import Holding
    from gpushared.inspect.view import render_details

    used = GpuInventory(unit=INV.unit, gpus=(dataclasses.replace(INV.gpus[0], used_mib=5120), INV.gpus[1]))
    holding = Holding(uid="u", namespace="default", name="p", gpus={0: 4})
    text = render_details([node_report(name="n1", address="10.0.0.1", inventory=used, holdings=[holding])])
    table = text.splitlines()
    assert table[3].split() == ["NAME", "NAMESPACE", "GPU0(Allocated)", "GPU1(Allocated)"]
    assert table[4].split() == ["p", "default", "4", "0"]
    assert table[5].split() == ["(in", "use,", "MiB)", "5120", "-"]


def _node(version: int, text: str) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "resourceVersion": str(version), "annotations": {contract.NODE_INVENTORY: text}}}


def test_a_foreign_edit_is_written_over_even_when_it_lands_during_the_daemons_own_write() -> None:
    """The Node watch's events against the daemon's writes (issue #39, defect 5): an event older than the
    daemon's last write is not news; an edit the watch shows while a write of the daemon's is under way is
    still written over at the next tick (a lost flag once left a forged inventory in place)."""
    node, api = publisher([0.0])
    versions = iter(range(10, 100))
    api.patch_node_status = lambda name, patch: (
        api.sent.append(patch),
        {"metadata": {"resourceVersion": str(next(versions))}},
    )[1]  # type: ignore[method-assign]
    node.publish(INV)
    ours = contract.format_inventory(INV)
    assert len(api.sent) == 1
    node.seen(None, _node(9, "an older edit, before our write"))  # not news
    node.publish(INV)
    assert len(api.sent) == 1
    forged = ours.replace('"memory":16', '"memory":80', 1)
    node.seen(None, _node(11, forged))
    node.publish(INV)
    assert len(api.sent) == 2 and api.sent[-1]["metadata"]["annotations"][contract.NODE_INVENTORY] == ours

    def write_racing_an_edit(name: str, patch: dict[str, Any]) -> dict[str, Any]:
        api.sent.append(patch)
        node.seen(None, _node(13, forged))  # the watch shows an edit made right after ours
        return {"metadata": {"resourceVersion": "12"}}

    api.patch_node_status = write_racing_an_edit  # type: ignore[method-assign]
    node.seen(None, _node(12, forged))
    node.publish(INV)
    assert len(api.sent) == 3
    api.patch_node_status = lambda name, patch: (api.sent.append(patch), {"metadata": {"resourceVersion": "14"}})[1]  # type: ignore[method-assign]
    node.publish(INV)
    assert len(api.sent) == 4  # the edit seen during the write is written over too
    assert node.restored == 3
