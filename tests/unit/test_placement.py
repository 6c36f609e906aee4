"""Choosing a GPU: Aliyun's best fit, spread, unhealthy GPUs, MPS apart, pods on several GPUs, reasons."""

from __future__ import annotations

import pytest

from gpushared import contract
from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.policies import (
    BINPACK,
    SPREAD,
    TIEBREAK,
    NodeRank,
)
from gpushared.core.shared.ledger import Holding, Ledger, holding_from_pod
from gpushared.core.shared.requests import ContainerRequest, PodRequest, pod_request
from gpushared.core.shared.verdicts import explain, judge, most_free, no_room
from tests.builders import inventory, on_gpus, pod
from tests.placing import PLAIN, appraised, gang, request, used


def test_best_fit_example_from_the_seed() -> None:
    """GPUs with 12207 / 8138 / 4069 / 16276 MiB free: a request of 8138 lands on the 8138 GPU."""
    ledger = Ledger.build(inventory(12207, 8138, 4069, 16276, unit=MemoryUnit.MIB))
    choice = BINPACK.choose(judge(ledger, request(8138)), request(8138), PLAIN)
    assert choice is not None and choice[0].gpu.index == 1


def test_best_fit_ties_go_to_the_lowest_index() -> None:
    ledger = Ledger.build(inventory(16, 16, 16))
    used(ledger, 0, 8)
    used(ledger, 2, 8)
    choice = BINPACK.choose(judge(ledger, request(4)), request(4), PLAIN)
    assert choice is not None and choice[0].gpu.index == 0


def test_spread_takes_the_emptiest_gpu() -> None:
    ledger = Ledger.build(inventory(16, 16, 16))
    used(ledger, 0, 8)
    choice = SPREAD.choose(judge(ledger, request(4)), request(4), PLAIN)
    assert choice is not None and choice[0].gpu.index == 1


def test_unhealthy_gpus_are_never_chosen_and_say_why() -> None:
    inv = inventory(16, 16)
    sick = GpuInventory(unit=inv.unit, gpus=(GpuInfo(**{**inv.gpus[0].__dict__, "healthy": False}), inv.gpus[1]))
    verdicts = judge(Ledger.build(sick), request(4))
    assert verdicts[0].reason == "GPU 0 is unhealthy"
    choice = BINPACK.choose(verdicts, request(4), PLAIN)
    assert choice is not None and choice[0].gpu.index == 1


def test_reasons_a_person_understands() -> None:
    ledger = Ledger.build(inventory(8, 16))
    used(ledger, 0, 5)
    used(ledger, 1, 13)
    verdicts = judge(ledger, request(4))
    assert BINPACK.choose(verdicts, request(4), PLAIN) is None
    assert explain(verdicts) == "GPU 0 has 3 GiB free, pod needs 4 GiB; GPU 1 has 3 GiB free, pod needs 4 GiB"
    assert explain([]) == "node has no GPUs"


def test_mps_and_plain_pods_never_share_a_gpu() -> None:
    ledger = Ledger.build(inventory(16, 16, 16, mps=True))
    used(ledger, 0, 2, mps=True)
    used(ledger, 1, 2)
    plain = judge(ledger, request(2))
    assert plain[0].reason == "GPU 0 serves MPS pods"
    mps = judge(ledger, request(2, mps=True))
    assert mps[1].reason == "GPU 1 is shared by pods without MPS"
    assert BINPACK.choose(plain, request(2), PLAIN)[0].gpu.index == 1  # type: ignore[union-attr]
    assert BINPACK.choose(mps, request(2, mps=True), PLAIN)[0].gpu.index == 0  # type: ignore[union-attr]


def test_mps_needs_an_mps_server_and_room_for_a_client() -> None:
    assert judge(Ledger.build(inventory(16)), request(1, mps=True))[0].reason == "GPU 0 runs no MPS server"
    ledger = Ledger.build(inventory(64, mps=True))
    for i in range(3):
        ledger.add(Holding(uid=str(i), namespace="d", name="x", gpus={0: 1}, mps=True))
    assert (
        judge(ledger, request(1, mps=True), max_mps_clients=3)[0].reason == "GPU 0 has 3 MPS clients, the most it takes"
    )


def test_bind_annotations_read_back_as_the_same_holding() -> None:
    inv = inventory(8, 24)
    body = pod("p", 3, 2, init=[{"name": "warm", "resources": {"limits": {contract.DEFAULT_RESOURCES.gpu_mem: "6"}}}])
    req = pod_request(body)
    annotations = bind_annotations(req, [inv.gpus[1]], unit=inv.unit, now_ns=1_700_000_000_123_456_789)
    assert annotations[contract.ALIYUN_GPU_MEM_IDX] == "1"
    assert annotations[contract.ALIYUN_GPU_MEM_DEV] == "24"
    assert annotations[contract.ALIYUN_GPU_MEM_POD] == "6"
    assert annotations[contract.ALIYUN_GPU_MEM_ASSIGNED] == "false"
    assert annotations[contract.ALIYUN_GPU_MEM_ASSUME_TIME] == "1700000000123456789"
    allocation = contract.parse_allocation(annotations[contract.POD_ALLOCATION])
    assert [(c.name, c.init, c.gpus[0].uuid, c.gpus[0].amount) for c in allocation.containers] == [
        ("warm", True, inv.gpus[1].uuid, 6),
        ("c0", False, inv.gpus[1].uuid, 3),
        ("c1", False, inv.gpus[1].uuid, 2),
    ]
    body["metadata"]["annotations"] = annotations
    holding = holding_from_pod(body, unit=inv.unit)
    assert holding is not None and holding.gpus == {1: 6}


def test_a_pod_without_gpu_memory_is_not_placed() -> None:
    nothing = PodRequest(containers=())
    verdicts = judge(Ledger.build(inventory(8, 8)), nothing)
    assert BINPACK.choose(verdicts, nothing, PLAIN) is None
    assert explain(verdicts) == "pod requests no GPU memory"


def test_a_pod_on_several_gpus_needs_its_share_free_on_each_of_that_many() -> None:
    ledger = Ledger.build(inventory(16, 16, 16, 16))
    used(ledger, 0, 12)
    used(ledger, 1, 6)
    verdicts = judge(ledger, gang(8, 2))
    assert [v.fits for v in verdicts] == [False, True, True, True]
    assert verdicts[0].reason == "GPU 0 has 4 GiB free, pod needs 8 GiB on each of 2 GPUs"
    # Best fit takes the two GPUs left tightest, spread the two emptiest.
    assert [v.gpu.index for v in BINPACK.choose(verdicts, gang(8, 2), PLAIN) or ()] == [1, 2]
    assert [v.gpu.index for v in SPREAD.choose(verdicts, gang(8, 2), PLAIN) or ()] == [2, 3]
    # The node's price: its 46 GiB free less 16, in GPUs of 16, then a hair of the two GPUs' 2 + 8 left.
    assert appraised(ledger, gang(8, 2)) == NodeRank(30 / 16 + TIEBREAK * (2 + 8) / (2 * 65))
    # Three of the four have room for 8; none of a pod that needs four of them.
    assert BINPACK.choose(judge(ledger, gang(8, 4)), gang(8, 4), PLAIN) is None
    assert explain(judge(ledger, gang(8, 4)), gpus=4) == (
        "3 of the node's GPUs have room, the pod needs 4; GPU 0 has 4 GiB free, pod needs 8 GiB on each of 4 GPUs"
    )
    # The filter's room: the most free on each of N usable GPUs.
    assert [most_free(ledger, mps=False, gpus=n) for n in (1, 2, 3, 4, 5)] == [16, 16, 10, 4, -1]


def test_the_mix_counts_pods_on_several_gpus_by_the_gpus_left_with_room() -> None:
    mix = RequestMix([(1000, 16, 2), (4000, 16, 4)])
    # Two whole GPUs: the pairs can use them, the fours cannot; with 2 CPUs left neither can.
    assert mix.fragment([16, 16, 8]) == pytest.approx(0.5 * 8 + 0.5 * 40)
    assert mix.fragment([16, 16, 8], cpu_free=2000) == pytest.approx(0.5 * 8 + 0.5 * 40)
    assert mix.fragment([16, 16, 8], cpu_free=500) == pytest.approx(40.0)
    assert mix.fragment([16, 16, 16, 16], cpu_free=None) == 0.0


def test_a_pod_on_several_gpus_gets_our_allocation_only() -> None:
    """Aliyun's annotations name one GPU; a reader of them would count all of it there."""
    inv = inventory(16, 16, 16)
    req = pod_request(on_gpus(pod("train", 32), 2))
    annotations = bind_annotations(req, [inv.gpus[2], inv.gpus[0]], unit=inv.unit, now_ns=1)
    assert contract.ALIYUN_GPU_MEM_IDX not in annotations and contract.ALIYUN_GPU_MEM_POD not in annotations
    allocation = contract.parse_allocation(annotations[contract.POD_ALLOCATION])
    assert [(s.index, s.amount) for s in allocation.containers[0].gpus] == [(2, 16), (0, 16)]
    body = on_gpus(pod("train", 32, node="n1", annotations=annotations), 2)
    holding = holding_from_pod(body, unit=inv.unit)
    assert holding is not None and holding.gpus == {0: 16, 2: 16}


def test_aliyun_keys_a_pod_on_several_gpus_arrived_with_are_overwritten() -> None:
    """A pod created with ALIYUN_COM_GPU_MEM_IDX already set (copied from a running pod, or forged) must not
    keep it: Aliyun's tools would show it on that GPU. The Binding says "not on one GPU" instead."""
    inv = inventory(16, 16, 16)
    req = pod_request(on_gpus(pod("train", 32), 2))
    carried = {contract.ALIYUN_GPU_MEM_IDX, contract.ALIYUN_GPU_MEM_POD, contract.ALIYUN_GPU_MEM_DEV}
    annotations = bind_annotations(req, [inv.gpus[2], inv.gpus[0]], unit=inv.unit, now_ns=1, carried=carried)
    assert annotations[contract.ALIYUN_GPU_MEM_IDX] == "-1"
    assert annotations[contract.ALIYUN_GPU_MEM_POD] == "32" and annotations[contract.ALIYUN_GPU_MEM_DEV] == "0"


@pytest.mark.parametrize(
    "edit",
    [
        {contract.ALIYUN_GPU_MEM_POD: "0"},
        {contract.POD_ALLOCATION: '{"version": 1, "unit": "GiB", "containers": [{"name": "c0", "gpus": '
         '[{"index": 1, "uuid": "GPU-1", "amount": 0}]}]}'},
    ],
)  # fmt: skip
def test_what_a_pod_holds_never_falls_below_its_spec(edit: dict[str, str]) -> None:
    """Defect: patching the allocation or ALIYUN_COM_GPU_MEM_POD to 0 on a running pod freed its memory."""
    inv = inventory(16, 16)
    body = pod("p", 6, node="n1")
    body["metadata"]["annotations"] = bind_annotations(pod_request(body), [inv.gpus[1]], unit=inv.unit, now_ns=1)
    body["metadata"]["annotations"].update(edit)
    holding = holding_from_pod(body, unit=inv.unit)
    assert holding is not None and holding.gpus == {1: 6} and holding.pending == 0


def test_the_filters_reason_for_full_gpus_is_the_same_on_every_node() -> None:
    """kube-scheduler counts equal reasons into one entry of its FailedScheduling message."""
    assert no_room(request(8), unit=contract.MemoryUnit.GIB) == "no usable GPU has 8 GiB free"
    assert no_room(request(512), unit=contract.MemoryUnit.MIB) == "no usable GPU has 512 MiB free"
    pair = PodRequest(containers=(ContainerRequest("c0", 32, gpus=2),))
    assert no_room(pair, unit=contract.MemoryUnit.GIB) == "fewer than 2 usable GPUs have 16 GiB free each"
