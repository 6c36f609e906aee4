"""Choosing a GPU: Aliyun's best fit, spread, fragmentation-aware, MPS separation, reasons and scores."""

from __future__ import annotations

import pytest

from gpushared import contract
from gpushared.contract import ContractError, GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.fragmentation import RequestMix
from gpushared.core.ledger import Holding, Ledger, holding_from_pod
from gpushared.core.placement import (
    BINPACK,
    FGD,
    SPREAD,
    bind_annotations,
    explain,
    idle_gpu_mib,
    judge,
    node_scores,
    policy_named,
)
from gpushared.core.requests import ContainerRequest, PodRequest, pod_request
from tests.builders import inventory, pod


def request(amount: int, *, mps: bool = False) -> PodRequest:
    return PodRequest(containers=(ContainerRequest("c0", amount),), mps=mps)


NO_MIX = RequestMix()


def used(ledger: Ledger, index: int, amount: int, *, mps: bool = False) -> None:
    ledger.add(Holding(uid=f"u{index}-{amount}-{mps}", namespace="d", name="x", gpus={index: amount}, mps=mps))


def test_best_fit_example_from_the_seed() -> None:
    """GPUs with 12207 / 8138 / 4069 / 16276 MiB free: a request of 8138 lands on the 8138 GPU."""
    ledger = Ledger.build(inventory(12207, 8138, 4069, 16276, unit=MemoryUnit.MIB))
    choice = BINPACK.choose(judge(ledger, request(8138)), request(8138), NO_MIX)
    assert choice is not None and choice.gpu.index == 1


def test_best_fit_ties_go_to_the_lowest_index() -> None:
    ledger = Ledger.build(inventory(16, 16, 16))
    used(ledger, 0, 8)
    used(ledger, 2, 8)
    choice = BINPACK.choose(judge(ledger, request(4)), request(4), NO_MIX)
    assert choice is not None and choice.gpu.index == 0


def test_spread_takes_the_emptiest_gpu() -> None:
    ledger = Ledger.build(inventory(16, 16, 16))
    used(ledger, 0, 8)
    choice = SPREAD.choose(judge(ledger, request(4)), request(4), NO_MIX)
    assert choice is not None and choice.gpu.index == 1


def test_unhealthy_gpus_are_never_chosen_and_say_why() -> None:
    inv = inventory(16, 16)
    sick = GpuInventory(unit=inv.unit, gpus=(GpuInfo(**{**inv.gpus[0].__dict__, "healthy": False}), inv.gpus[1]))
    verdicts = judge(Ledger.build(sick), request(4))
    assert verdicts[0].reason == "GPU 0 is unhealthy"
    choice = BINPACK.choose(verdicts, request(4), NO_MIX)
    assert choice is not None and choice.gpu.index == 1


def test_reasons_a_person_understands() -> None:
    ledger = Ledger.build(inventory(8, 16))
    used(ledger, 0, 5)
    used(ledger, 1, 13)
    verdicts = judge(ledger, request(4))
    assert BINPACK.choose(verdicts, request(4), NO_MIX) is None
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
    assert BINPACK.choose(plain, request(2), NO_MIX).gpu.index == 1  # type: ignore[union-attr]
    assert BINPACK.choose(mps, request(2, mps=True), NO_MIX).gpu.index == 0  # type: ignore[union-attr]


def test_mps_needs_an_mps_server_and_room_for_a_client() -> None:
    assert judge(Ledger.build(inventory(16)), request(1, mps=True))[0].reason == "GPU 0 runs no MPS server"
    ledger = Ledger.build(inventory(64, mps=True))
    for i in range(3):
        ledger.add(Holding(uid=str(i), namespace="d", name="x", gpus={0: 1}, mps=True))
    assert (
        judge(ledger, request(1, mps=True), max_mps_clients=3)[0].reason == "GPU 0 has 3 MPS clients, the most it takes"
    )


def test_scores_give_the_top_only_to_the_cheapest_nodes() -> None:
    tight = Ledger.build(inventory(16))
    used(tight, 0, 10)
    roomy = Ledger.build(inventory(16))
    req = request(4)
    binpack = [BINPACK.node_cost(judge(ledger, req), req, NO_MIX) for ledger in (tight, roomy, tight)]
    assert binpack == [2.0, 12.0, 2.0]
    assert node_scores(binpack) == [10, 0, 10]
    spread = [SPREAD.node_cost(judge(ledger, req), req, NO_MIX) for ledger in (tight, roomy)]
    assert node_scores(spread) == [0, 10]
    assert BINPACK.node_cost(judge(tight, request(7)), request(7), NO_MIX) is None
    assert node_scores([None, 3.0, 4.0, 4.0 + 1e-12, 12.0, None]) == [0, 10, 8, 8, 0, 0]
    assert node_scores([1.0, 1.0 + 1e-12]) == [10, 10]  # equal, up to float sums
    assert node_scores([None, None]) == [0, 0]


def test_fgd_leaves_what_the_mix_can_use() -> None:
    """Best fit would put 4 on the GPU with 6 free, leaving 2 that no pod of this mix can use; FGD leaves
    4 on the 8 GPU instead, which most of the mix can use."""
    ledger = Ledger.build(inventory(16, 16))
    used(ledger, 0, 10)
    used(ledger, 1, 8)
    mix = RequestMix([4, 4, 4, 6])
    req = request(4)
    assert BINPACK.choose(judge(ledger, req), req, mix).gpu.index == 0  # type: ignore[union-attr]
    assert FGD.choose(judge(ledger, req), req, mix).gpu.index == 1  # type: ignore[union-attr]
    assert FGD.choose(judge(ledger, req), req, RequestMix()).gpu.index == 0  # type: ignore[union-attr]  # no mix: best fit
    assert FGD.node_cost(judge(ledger, req), req, mix) == pytest.approx(4 * 0.25 - 8 * 0.0)


def test_policy_names() -> None:
    assert policy_named("binpack") is BINPACK
    with pytest.raises(ContractError, match="unknown placement policy; choose one of binpack, spread, fgd"):
        policy_named("random")


def test_bind_annotations_read_back_as_the_same_holding() -> None:
    inv = inventory(8, 24)
    body = pod("p", 3, 2, init=[{"name": "warm", "resources": {"limits": {contract.DEFAULT_RESOURCES.gpu_mem: "6"}}}])
    req = pod_request(body)
    annotations = bind_annotations(req, inv.gpus[1], unit=inv.unit, now_ns=1_700_000_000_123_456_789)
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
    assert BINPACK.choose(verdicts, nothing, NO_MIX) is None
    assert explain(verdicts) == "pod requests no GPU memory"


def test_a_pod_without_gpu_is_priced_by_the_gpu_memory_it_would_strand() -> None:
    inv = inventory(16, 8, 8)
    sick = GpuInventory(unit=inv.unit, gpus=(*inv.gpus[:2], GpuInfo(**{**inv.gpus[2].__dict__, "healthy": False})))
    ledger = Ledger.build(sick)
    used(ledger, 0, 10)
    assert idle_gpu_mib(ledger) == (6 + 8) * 1024  # GiB in MiB; the unhealthy GPU takes no pod anyway
    used(ledger, 1, 8)
    assert idle_gpu_mib(ledger) == 6 * 1024
    assert idle_gpu_mib(Ledger.build(inventory(3000, unit=MemoryUnit.MIB))) == 3000
    assert idle_gpu_mib(None) == 0  # no GPUs known: nothing to strand
    # The fullest node scores highest: the pod's CPU goes where no GPU waits for it.
    assert node_scores([idle_gpu_mib(None), 6 * 1024.0, 14 * 1024.0]) == [10, 5, 0]
