"""The per-node ledger: what pods hold, derived from their annotations, and when they stop holding it."""

from __future__ import annotations

import json

import pytest

from gpushared import contract
from gpushared.contract import MemoryUnit
from gpushared.core.shared.ledger import (
    GpuMode,
    Holding,
    Ledger,
    holding_from_pod,
    holds_gpu_memory,
    inventory_from_node,
)
from tests.builders import GPU_MEM, inventory, pod


def aliyun(idx: int, amount: int) -> dict[str, str]:
    return {
        contract.ALIYUN_GPU_MEM_IDX: str(idx),
        contract.ALIYUN_GPU_MEM_POD: str(amount),
        contract.ALIYUN_GPU_MEM_ASSIGNED: "true",
        contract.ALIYUN_GPU_MEM_ASSUME_TIME: "1700000000000000000",
    }


def test_aliyun_annotated_pod_holds_its_pod_amount_on_its_index() -> None:
    holding = holding_from_pod(pod("a", 4, node="n1", annotations=aliyun(1, 4)), unit=MemoryUnit.GIB)
    assert holding is not None
    assert (holding.gpus, holding.pending, holding.assigned, holding.problem) == ({1: 4}, 0, True, None)


def test_pod_without_gpu_mem_holds_nothing() -> None:
    assert holding_from_pod(pod("a", node="n1"), unit=MemoryUnit.GIB) is None


def test_pod_that_bypassed_the_extender_is_pending_on_the_node() -> None:
    holding = holding_from_pod(pod("a", 3, node="n1"), unit=MemoryUnit.GIB)
    assert holding is not None
    assert (holding.gpus, holding.pending) == ({}, 3)


def test_malformed_index_is_held_as_pending_with_the_reason() -> None:
    holding = holding_from_pod(pod("a", 3, annotations={contract.ALIYUN_GPU_MEM_IDX: "one"}), unit=MemoryUnit.GIB)
    assert holding is not None
    assert holding.pending == 3
    assert holding.problem is not None and "ALIYUN_COM_GPU_MEM_IDX: expected a decimal integer" in holding.problem


def test_allocation_annotation_is_trusted_over_aliyuns_and_converted_to_the_node_unit() -> None:
    allocation = json.dumps(
        {
            "version": 1,
            "unit": "MiB",
            "initContainers": [{"name": "init", "gpus": [{"index": 0, "uuid": "u0", "amount": 3000}]}],
            "containers": [
                {"name": "a", "gpus": [{"index": 0, "uuid": "u0", "amount": 1024}]},
                {"name": "b", "gpus": [{"index": 0, "uuid": "u0", "amount": 1025}]},
            ],
        }
    )
    annotations = {**aliyun(1, 99), contract.POD_ALLOCATION: allocation}
    holding = holding_from_pod(pod("p", 1, 1, annotations=annotations), unit=MemoryUnit.GIB)
    assert holding is not None
    assert holding.gpus == {0: 3}  # max(3000, 2049) MiB, rounded up to GiB


def newer_allocation(index: int, amount: int) -> str:
    """What a later release's extender might write: a version this one cannot read."""
    gpus = [{"index": index, "uuid": "u", "amount": amount, "somethingNew": True}]
    return json.dumps(
        {"version": contract.CONTRACT_VERSION + 1, "unit": "GiB", "containers": [{"name": "c0", "gpus": gpus}]}
    )


def test_an_allocation_from_a_newer_release_is_counted_by_aliyuns_keys_written_with_it() -> None:
    """A rollback: pods bound by the newer extender keep their GPU in an older reader's books."""
    annotations = {**aliyun(2, 4), contract.POD_ALLOCATION: newer_allocation(2, 4)}
    holding = holding_from_pod(pod("a", 4, annotations=annotations), unit=MemoryUnit.GIB)
    assert holding is not None
    assert (holding.gpus, holding.pending, holding.problem) == ({2: 4}, 0, None)


@pytest.mark.parametrize("aliyun_keys", [{}, aliyun(-1, 8)], ids=["no Aliyun keys", "on several GPUs"])
def test_without_a_single_gpu_in_aliyuns_keys_a_newer_allocation_is_pending_with_the_reason(
    aliyun_keys: dict[str, str],
) -> None:
    annotations = {**aliyun_keys, contract.POD_ALLOCATION: newer_allocation(0, 8)}
    holding = holding_from_pod(pod("a", 8, annotations=annotations), unit=MemoryUnit.GIB)
    assert holding is not None
    assert (holding.gpus, holding.pending) == ({}, 8)
    assert holding.problem is not None and "newer than this gpushared reads" in holding.problem


def test_a_malformed_allocation_is_never_replaced_by_aliyuns_keys() -> None:
    """Only a newer version falls back: a broken annotation is a fault to report, not to paper over."""
    annotations = {**aliyun(1, 4), contract.POD_ALLOCATION: '{"version": 1, "unit": "GiB"'}
    holding = holding_from_pod(pod("a", 4, annotations=annotations), unit=MemoryUnit.GIB)
    assert holding is not None
    assert (holding.gpus, holding.pending) == ({}, 4) and "not valid JSON" in (holding.problem or "")


def test_framework_allocation_is_read() -> None:
    annotations = {contract.ALIYUN_FRAMEWORK_ALLOCATION: '{"0":{"2":3},"1":{"2":1}}'}
    holding = holding_from_pod(pod("p", 3, 1, annotations=annotations), unit=MemoryUnit.GIB)
    assert holding is not None and holding.gpus == {2: 4}


@pytest.mark.parametrize(
    ("status", "deleting", "holds"),
    [
        ({"phase": "Running"}, False, True),
        ({"phase": "Succeeded"}, False, False),
        ({"phase": "Failed"}, True, False),
        ({"phase": "Running"}, True, True),  # no container status yet: still holding
        ({"phase": "Running", "containerStatuses": [{"name": "c0", "state": {"running": {}}}]}, True, True),
        (
            {
                "phase": "Running",
                "containerStatuses": [
                    {"name": "c0", "state": {"terminated": {"exitCode": 0}}},
                    {"name": "c1", "state": {"running": {}}},
                ],
            },
            True,
            True,
        ),
        (
            {
                "phase": "Running",
                "containerStatuses": [{"name": "c0", "state": {"terminated": {"exitCode": 137}}}],
            },
            True,
            False,
        ),
    ],
)
def test_terminating_pods_hold_until_their_containers_stop(status: dict, deleting: bool, holds: bool) -> None:  # type: ignore[type-arg]
    body = pod("p", 2, annotations=aliyun(0, 2))
    body["status"] = status
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:00Z"
    assert holds_gpu_memory(body) is holds
    assert (holding_from_pod(body, unit=MemoryUnit.GIB) is not None) is holds


def test_ledger_counts_used_free_and_modes() -> None:
    ledger = Ledger.build(inventory(8, 16))
    ledger.add(Holding(uid="a", namespace="d", name="a", gpus={0: 3}))
    ledger.add(Holding(uid="b", namespace="d", name="b", gpus={1: 5}, mps=True))
    ledger.add(Holding(uid="c", namespace="d", name="c", gpus={}, pending=2))
    gpu0, gpu1 = ledger.inventory.gpus
    # c's 2 units are on some GPU of the node, which one cannot be read: taken from the room of each
    assert (ledger.free(gpu0), ledger.free(gpu1)) == (3, 9)
    assert (ledger.mode(0), ledger.mode(1)) == (GpuMode.SHARED, GpuMode.MPS)
    assert ledger.mps_clients(1) == 1
    assert (ledger.pending, ledger.used_total) == (2, 10)
    # Re-adding a pod replaces its old holding instead of counting it twice.
    ledger.add(Holding(uid="a", namespace="d", name="a", gpus={1: 1}))
    assert (ledger.used(0), ledger.used(1), ledger.mode(0)) == (0, 6, GpuMode.EMPTY)
    assert ledger.mode(1) is GpuMode.MPS
    assert ledger.remove("b") is not None
    assert ledger.mode(1) is GpuMode.SHARED
    assert ledger.remove("missing") is None


def test_orphaned_holdings_on_a_gpu_that_is_gone() -> None:
    ledger = Ledger.build(inventory(8), [Holding(uid="a", namespace="d", name="a", gpus={3: 2})])
    assert ledger.orphaned() == {3: 2}


def test_inventory_annotation_wins_over_capacity() -> None:
    inv = inventory(15, 7, unit=MemoryUnit.GIB)
    node = {
        "metadata": {"name": "n1", "annotations": {contract.NODE_INVENTORY: contract.format_inventory(inv)}},
        "status": {"capacity": {GPU_MEM: "44", contract.DEFAULT_RESOURCES.gpu_count: "2"}},
    }
    assert inventory_from_node(node) == inv


@pytest.mark.parametrize(
    ("total", "count", "unit", "per_gpu"),
    [("64", "4", MemoryUnit.GIB, 16), ("32560", "2", MemoryUnit.MIB, 16280)],
)
def test_aliyun_node_falls_back_to_capacity_over_count(total: str, count: str, unit: MemoryUnit, per_gpu: int) -> None:
    node = {
        "metadata": {"name": "n1"},
        "status": {"capacity": {GPU_MEM: total, contract.DEFAULT_RESOURCES.gpu_count: count}},
    }
    inv = inventory_from_node(node)
    assert inv is not None
    assert inv.unit is unit
    assert [g.memory for g in inv.gpus] == [per_gpu] * int(count)


def test_node_without_gpu_mem_is_not_a_gpushared_node() -> None:
    assert inventory_from_node({"metadata": {"name": "n"}, "status": {"capacity": {"cpu": "4"}}}) is None
    assert inventory_from_node({"status": {"capacity": {GPU_MEM: "0"}}}) is None


@pytest.mark.parametrize(
    ("asked", "recorded", "edited", "node", "holds"),
    [
        pytest.param("50", True, "100", "n1", 50, id="raised after bind: the bind record"),
        pytest.param("50", True, "0", "n1", 50, id="lowered after bind: the bind record"),
        pytest.param("50", True, None, "n1", 50, id="removed after bind: the bind record"),
        pytest.param(None, True, "100", "n1", 0, id="added after a bind that recorded none: none"),
        pytest.param(None, False, "100", "n1", 0, id="Aliyun's bind (no share recorded): none"),
        pytest.param("30", False, "60", None, 60, id="waiting: what it asks now"),
    ],
)
def test_a_placed_pods_compute_is_its_bind_records(
    asked: str | None, recorded: bool, edited: str | None, node: str | None, holds: int
) -> None:
    """Defect (issue #52, item 1): the books counted the larger of the bind record and the annotation, so an
    owner who raised a bound pod's compute request from 50 to 100 had a neighbour refused."""
    from gpushared.core.placement.binding import bind_annotations
    from gpushared.core.shared.requests import pod_request

    body = pod("a", 2, node=node, annotations={} if asked is None else {contract.POD_COMPUTE_REQUEST: asked})
    annotations = body["metadata"]["annotations"]
    if node is not None:
        gpus = inventory(16).gpus
        annotations.update(
            bind_annotations(pod_request(body), [gpus[0]], unit=MemoryUnit.GIB, now_ns=1) if recorded else aliyun(0, 2)
        )
    annotations.pop(contract.POD_COMPUTE_REQUEST, None)
    if edited is not None:
        annotations[contract.POD_COMPUTE_REQUEST] = edited
    holding = holding_from_pod(body, unit=MemoryUnit.GIB)
    assert holding is not None and holding.compute == holds
