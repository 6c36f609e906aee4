"""Naming the container an Allocate call is for, from the kubelet's pod manager and the annotations."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpushared import contract
from gpushared.contract import DEFAULT_RESOURCES, MemoryUnit
from gpushared.core.node.handshake import Candidate, Unidentified, candidate, identify
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from tests.builders import container, inventory, on_gpus, pod

INV = inventory(16, 16, 8)


def placed(name: str, *amounts: int, gpu: int, init: list[dict[str, Any]] | None = None, at: int = 1) -> dict[str, Any]:
    body = pod(name, *amounts, init=init, node="n1")
    body["metadata"]["annotations"].update(
        bind_annotations(pod_request(body), [INV.gpus[gpu]], unit=INV.unit, now_ns=at)
    )
    return body


def option(
    body: dict[str, Any], listed: dict[str, list[str]] | None = None, served: set[str] | None = None
) -> Candidate | None:
    return candidate(body, listed=listed, served=served or set(), unit=MemoryUnit.GIB, resources=DEFAULT_RESOURCES)


def test_the_one_pod_without_devices_is_named_with_its_next_container() -> None:
    body = placed("p", 2, 3, gpu=1, init=[container("warm", 4)])
    first = option(body, listed={"c0": [], "c1": []})
    assert first is not None
    assert (first.next.container, first.next.amount, first.next.indices) == ("warm", 4, [1])  # type: ignore[union-attr]
    after_init = option(body, listed={"c0": [], "c1": []}, served={"warm"})
    assert after_init.next.container == "c0"  # type: ignore[union-attr]
    after_c0 = option(body, listed={"c0": ["1-0", "1-1"], "c1": []})
    assert after_c0.next.container == "c1"  # type: ignore[union-attr]
    assert option(body, listed={"c0": ["1-0"], "c1": ["1-2"]}) is None  # admitted
    assert identify(3, [after_c0], unit=MemoryUnit.GIB, node="n1").chosen is after_c0  # type: ignore[list-item]


def test_finished_assigned_and_gpu_less_pods_are_not_candidates() -> None:
    done = placed("done", 2, gpu=0)
    done["status"]["phase"] = "Succeeded"
    assert option(done, listed={"c0": []}) is None
    assigned = placed("a", 2, gpu=0)
    assigned["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_ASSIGNED] = "true"
    assert option(assigned, listed={"c0": []}) is None
    assert option(pod("cpu-only", node="n1"), listed={"c0": []}) is None


def test_aliyun_placed_pods_use_their_index() -> None:
    body = pod("old", 3, node="n1", annotations={contract.ALIYUN_GPU_MEM_IDX: "2", contract.ALIYUN_GPU_MEM_POD: "3"})
    found = option(body, listed={"c0": []})
    assert (found.next.gpus, found.next.amount) == (((2, None),), 3)  # type: ignore[union-attr]


def test_equal_waiting_pods_on_one_gpu_are_interchangeable() -> None:
    a, b = option(placed("a", 2, gpu=1, at=20)), option(placed("b", 2, gpu=1, at=10))
    decision = identify(2, [a, b], unit=MemoryUnit.GIB, node="n1")  # type: ignore[list-item]
    assert decision.chosen is b  # oldest assume time
    assert decision.ambiguous_but_equivalent == ["default/a"]


def test_equal_waiting_pods_on_different_gpus_are_refused_not_guessed() -> None:
    a, b = option(placed("a", 2, gpu=0)), option(placed("b", 2, gpu=1))
    with pytest.raises(Unidentified, match="cannot tell which of pods default/a, default/b") as info:
        identify(2, [a, b], unit=MemoryUnit.GIB, node="n1")  # type: ignore[list-item]
    assert info.value.retry


def test_the_reasons_when_nobody_matches() -> None:
    rogue = option(pod("rogue", 3, node="n1"), listed={"c0": []})
    with pytest.raises(Unidentified, match="not scheduled through gpushared-extender") as info:
        identify(3, [rogue], unit=MemoryUnit.GIB, node="n1")  # type: ignore[list-item]
    assert info.value.pod is not None
    waiting = option(placed("w", 4, gpu=0))
    with pytest.raises(Unidentified, match="kubelet asks for 3 GiB but container 'c0' was assigned 4 GiB on GPU 0"):
        identify(3, [waiting], unit=MemoryUnit.GIB, node="n1")  # type: ignore[list-item]
    with pytest.raises(Unidentified, match="no pod on node n1 is waiting for 3 GiB"):
        identify(3, [], unit=MemoryUnit.GIB, node="n1")


def test_malformed_annotations_are_named() -> None:
    body = pod("bad", 3, node="n1", annotations={contract.POD_ALLOCATION: "{"})
    found = option(body, listed={"c0": []})
    with pytest.raises(Unidentified, match=r"gpushared\.io/allocation: not valid JSON"):
        identify(3, [found], unit=MemoryUnit.GIB, node="n1")  # type: ignore[list-item]


def test_a_container_on_several_gpus_is_one_slot_with_each_gpu() -> None:
    body = on_gpus(pod("train", 16, node="n1"), 2)
    body["metadata"]["annotations"].update(
        bind_annotations(pod_request(body), [INV.gpus[1], INV.gpus[0]], unit=INV.unit, now_ns=1)
    )
    found = option(body, listed={"c0": []})
    assert found is not None and found.next is not None
    assert (found.next.amount, found.next.share, found.next.where) == (16, 8, "GPUs 1, 0")
    assert found.next.gpus == ((1, INV.gpus[1].uuid), (0, INV.gpus[0].uuid))
    assert identify(16, [found], unit=MemoryUnit.GIB, node="n1").chosen is found


@pytest.mark.parametrize(
    "shares",
    [
        [{"index": 0, "uuid": "GPU-a", "amount": 6}, {"index": 1, "uuid": "GPU-b", "amount": 2}],
        [{"index": 0, "uuid": "GPU-a", "amount": 4}, {"index": 0, "uuid": "GPU-a", "amount": 4}],
    ],
)
def test_uneven_or_repeated_gpus_of_a_container_are_refused(shares: list[dict[str, Any]]) -> None:
    allocation = {"version": 1, "unit": "GiB", "containers": [{"name": "c0", "gpus": shares}]}
    body = on_gpus(pod("odd", 8, node="n1", annotations={contract.POD_ALLOCATION: json.dumps(allocation)}), 2)
    found = option(body, listed={"c0": []})
    assert found is not None and found.slots is None
    assert found.problem is not None and "must take the same share of each, on GPUs that differ" in found.problem
