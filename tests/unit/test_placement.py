"""Choosing a GPU: Aliyun's best fit, spread, fragmentation-aware, MPS separation, reasons and scores."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared import contract
from gpushared.contract import ContractError, GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.placement.fragmentation import NodeClass, RequestMix
from gpushared.core.placement.policies import (
    BALANCED,
    BINPACK,
    EQUAL_PRICE,
    FGD,
    MAX_SCORE,
    SPREAD,
    TIEBREAK,
    NodeRank,
    Policy,
    best_nodes,
    node_scores,
    policy_named,
)
from gpushared.core.placement.pricing import NodeCpu, PricingContext
from gpushared.core.shared.ledger import Holding, Ledger, holding_from_pod
from gpushared.core.shared.requests import ContainerRequest, PodRequest, pod_request
from gpushared.core.shared.verdicts import explain, fitting, idle_gpu_mib, judge, most_free, no_room
from tests.builders import inventory, on_gpus, pod


def request(amount: int, *, mps: bool = False) -> PodRequest:
    return PodRequest(containers=(ContainerRequest("c0", amount),), mps=mps)


#: Binpack and spread read nothing of the node's setting but the verdicts.
PLAIN = PricingContext(Ledger.build(inventory(16)))


def used(ledger: Ledger, index: int, amount: int, *, mps: bool = False) -> None:
    ledger.add(Holding(uid=f"u{index}-{amount}-{mps}", namespace="d", name="x", gpus={index: amount}, mps=mps))


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


def appraised(
    ledger: Ledger, req: PodRequest, setting: PricingContext | None = None, policy: Policy = BINPACK
) -> NodeRank | None:
    found = policy.price_node(judge(ledger, req), req, setting or PricingContext(ledger))
    return None if found is None else found[0]


@pytest.mark.parametrize(
    "keys",
    [
        [None, NodeRank(3.0), NodeRank(4.0), NodeRank(3.0 + 1e-12), None],
        [NodeRank(1.0, 0.5), NodeRank(1.0, 0.2), NodeRank(2.0), NodeRank(1.0, 0.2)],
        [NodeRank(5.0, links=-400), NodeRank(1.0, links=-200), NodeRank(2.0, links=-400)],
        [None, None],
        [],
        [NodeRank(7.0)],
    ],
)
def test_best_nodes_are_the_ones_scored_highest(keys: list[NodeRank | None]) -> None:
    """What --rank-in-filter keeps is what prioritize gives the top score: the same choice for kube-scheduler."""
    top = [i for i, score in enumerate(node_scores(keys)) if score == MAX_SCORE and keys[i] is not None]
    assert best_nodes(keys) == top


def plain_scores(keys: list[NodeRank | None]) -> list[int]:
    """node_scores' rules as written in its docstring, one step at a time: what the one-pass version in
    core/placement/policies.py must always agree with."""
    known = [k for k in keys if k is not None]
    if not known:
        return [0] * len(keys)
    eq = EQUAL_PRICE
    links = min(k.links for k in known)
    cheapest = min(k.price for k in known if k.links <= links + eq)
    tiebreak = min(k.tiebreak for k in known if k.links <= links + eq and k.price <= cheapest + eq)
    linked = {i: k for i, k in enumerate(keys) if k is not None and k.links <= links + eq}
    worst = max(k.price for k in linked.values())
    scores: dict[int, int] = {}
    for i, k in linked.items():
        if k.price <= cheapest + eq and k.tiebreak <= tiebreak + eq:
            scores[i] = MAX_SCORE
        elif k.price <= cheapest + eq:
            scores[i] = MAX_SCORE - 1
        else:
            scores[i] = math.floor((MAX_SCORE - 1) * (worst - k.price) / (worst - cheapest) + eq)
    lowest = min(scores.values())
    worst_links = max(k.links for k in known)
    for i, k in enumerate(keys):
        if k is not None and i not in linked:
            scores[i] = min(lowest, math.floor((MAX_SCORE - 1) * (worst_links - k.links) / (worst_links - links)))
    return [scores.get(i, 0) for i in range(len(keys))]


#: Ranks as policies produce them: prices and tiebreaks that tie often (equal nodes), some only up to float
#: sums; links of multi-GPU sets.
RANKS = st.lists(
    st.none()
    | st.builds(
        NodeRank,
        st.sampled_from([0.0, 1.0, 1.0 + 1e-12, 2.5, 7.0]) | st.floats(-1e6, 1e6, allow_nan=False),
        st.sampled_from([0.0, 0.2, 0.5]) | st.floats(0, 1),
        st.sampled_from([0.0, 0.0, -100.0, -400.0, -400.0 + 1e-12]),
    ),
    max_size=40,
)


@settings(max_examples=500, deadline=None)
@given(RANKS)
def test_scores_follow_the_rules_as_written(keys: list[NodeRank | None]) -> None:
    assert node_scores(keys) == plain_scores(keys)
    assert best_nodes(keys) == [i for i, k in enumerate(keys) if k is not None and node_scores(keys)[i] == MAX_SCORE]


def test_scores_give_the_top_only_to_the_cheapest_nodes() -> None:
    tight = Ledger.build(inventory(16))
    used(tight, 0, 10)
    roomy = Ledger.build(inventory(16))
    req = request(4)
    binpack = [appraised(ledger, req) for ledger in (tight, roomy, tight)]
    # What the node has left in GPUs (its CPU not known here), then a hair of the GPU's own leftover.
    assert binpack == [NodeRank(2 / 16 + TIEBREAK * 2 / 17), NodeRank(12 / 16 + TIEBREAK * 12 / 17), binpack[0]]
    assert node_scores(binpack) == [10, 0, 10]
    spread = [appraised(ledger, req, policy=SPREAD) for ledger in (tight, roomy)]
    assert node_scores(spread) == [0, 10]
    assert appraised(tight, request(7)) is None
    costs = [None, 3.0, 4.0, 4.0 + 1e-12, 12.0, None]
    assert node_scores([None if c is None else NodeRank(c) for c in costs]) == [0, 10, 8, 8, 0, 0]
    assert node_scores([NodeRank(1.0), NodeRank(1.0 + 1e-12)]) == [10, 10]  # equal, up to float sums
    assert node_scores([None, None]) == [0, 0]
    # At the best price, the better balanced node alone gets the top score; the others stay below both.
    assert node_scores([NodeRank(1.0, 0.5), NodeRank(1.0, 0.2), NodeRank(2.0), NodeRank(5.0)]) == [9, 10, 6, 0]
    # Better linked first, whatever the price; the less well linked never above the best-linked's lowest.
    linked = [NodeRank(5.0, links=-400), NodeRank(1.0, links=-200), NodeRank(2.0, links=-400), NodeRank(1.0, links=-20)]
    assert node_scores(linked) == [0, 0, 10, 0]
    assert node_scores([NodeRank(1.0, links=-400), NodeRank(9.0, links=-400), NodeRank(1.0, links=-200)]) == [10, 0, 0]
    assert node_scores([NodeRank(1.0, links=-400), NodeRank(1.0, links=-300), NodeRank(1.0, links=-100)]) == [10, 6, 0]


def mix_of(*kinds: tuple[int, int]) -> RequestMix:
    """A mix of one-GPU and CPU-only kinds, given as (milli-CPU, size)."""
    return RequestMix((cpu, size, 1 if size else 0) for cpu, size in kinds)


def test_fgd_leaves_what_the_mix_can_use() -> None:
    """Best fit would put 4 on the GPU with 6 free, leaving 2 that no pod of this mix can use; FGD leaves
    4 on the 8 GPU instead, which most of the mix can use."""
    ledger = Ledger.build(inventory(16, 16))
    used(ledger, 0, 10)
    used(ledger, 1, 8)
    setting = PricingContext(ledger, mix=mix_of((1000, 4), (1000, 4), (1000, 4), (1000, 6)))
    req = request(4)
    assert BINPACK.choose(judge(ledger, req), req, setting)[0].gpu.index == 0  # type: ignore[union-attr]
    assert FGD.choose(judge(ledger, req), req, setting)[0].gpu.index == 1  # type: ignore[union-attr]
    assert FGD.choose(judge(ledger, req), req, PricingContext(ledger))[0].gpu.index == 0  # type: ignore[union-attr]  # no mix
    # On GPU 1 the fragment grows by 4 x 1/4 (a quarter of the mix asks more than 4): 1/16 of a GPU, whose
    # sigmoid is cut to 48 of 100 levels; on GPU 0 by 2 (all of it), 1/8 of a GPU: 46 levels.
    assert setting.growth(judge(ledger, req)[1:2], 4) == pytest.approx(1.0)
    assert setting.growth(judge(ledger, req)[:1], 4) == pytest.approx(2.0)
    assert appraised(ledger, req, setting, FGD) == NodeRank(-48.0)


def test_fgd_keeps_cpu_where_free_gpu_memory_needs_it() -> None:
    """Two nodes with the same GPU memory free; on the first the pod would leave too little CPU for any pod
    of the mix, stranding the 4 GiB left beside it. Best fit packs the node with less left, CPU counted:
    the short one; fgd sees what that strands."""
    mix = mix_of((4000, 4), (4000, 4), (4000, 2), (0, 0))
    short, ample = Ledger.build(inventory(16)), Ledger.build(inventory(16))
    used(short, 0, 8)
    used(ample, 0, 8)
    req = request(4)
    settings = [
        PricingContext(short, mix=mix, cpu=NodeCpu(allocatable=8000, requested=3000), pod_cpu=2000),
        PricingContext(ample, mix=mix, cpu=NodeCpu(allocatable=32000, requested=0), pod_cpu=2000),
    ]
    assert node_scores([appraised(s.ledger, req, s) for s in settings]) == [10, 0]
    fgd = [appraised(s.ledger, req, s, FGD) for s in settings]
    assert node_scores(fgd) == [0, 10]
    # Before, on both: the quarter of the mix without GPU cannot use the 8 free. After, on the short node
    # no pod of the mix can use the 4 left; on the ample one still only that quarter cannot.
    assert settings[0].growth(judge(short, req)[:1], 4) == pytest.approx(4 * 1.0 - 8 * 0.25)
    assert settings[1].growth(judge(ample, req)[:1], 4) == pytest.approx(4 * 0.25 - 8 * 0.25)


def test_fgd_gives_equal_growths_to_the_node_that_stays_balanced() -> None:
    """With no mix yet every growth is 0: the node whose CPU and GPU memory would be left in like shares
    wins, so neither runs out while the other waits."""
    full_cpu, balanced = Ledger.build(inventory(16)), Ledger.build(inventory(16))
    req = request(4)
    settings = [
        PricingContext(full_cpu, cpu=NodeCpu(allocatable=8000, requested=6000), pod_cpu=2000),  # CPU 0 %, GPU 75 % left
        PricingContext(balanced, cpu=NodeCpu(allocatable=8000, requested=0), pod_cpu=2000),  # 75 % and 75 %
    ]
    assert [s.imbalance(4) for s in settings] == [0.75, 0.0]
    assert node_scores([appraised(s.ledger, req, s, FGD) for s in settings]) == [9, 10]
    assert PricingContext(balanced).imbalance(4) == 0.0  # CPU not known: nothing to balance


def test_policy_names() -> None:
    assert policy_named("binpack") is BINPACK
    with pytest.raises(ContractError, match="unknown placement policy; choose one of binpack, spread, fgd"):
        policy_named("random")


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
    assert node_scores([NodeRank(idle_gpu_mib(None)), NodeRank(6 * 1024.0), NodeRank(14 * 1024.0)]) == [10, 5, 0]


def gang(per_gpu: int, gpus: int) -> PodRequest:
    return PodRequest(containers=(ContainerRequest("c0", per_gpu * gpus, gpus=gpus),))


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


def test_fgd_prices_a_pod_on_several_gpus_by_the_growth_of_all_it_takes() -> None:
    """A mix of whole-GPU pairs and pairs of halves: a pair of halves goes to the half-used GPUs, which keeps
    two whole GPUs together for the whole pairs."""
    ledger = Ledger.build(inventory(16, 16, 16, 16))
    used(ledger, 0, 8)
    used(ledger, 1, 8)
    mix = RequestMix([(1000, 16, 2), (1000, 8, 2)])
    setting = PricingContext(ledger, mix=mix)
    req = gang(8, 2)
    choice = FGD.choose(judge(ledger, req), req, setting)
    assert [v.gpu.index for v in choice or ()] == [0, 1]
    # Before: the pairs of halves can use all 48 free, the whole pairs all but the two halves: 16 x 1/2.
    # After taking GPUs 0 and 1, both kinds can use the 32 left.
    assert setting.growth(judge(ledger, req)[:2], 8) == pytest.approx(0 - 16 * 0.5)
    # Taking GPUs 2 and 3 instead leaves no two whole GPUs: all 32 free becomes fragment to the whole pairs.
    assert setting.growth(judge(ledger, req)[2:], 8) == pytest.approx(32 * 0.5 - 16 * 0.5)


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


def test_balanced_takes_the_gpu_with_the_fewest_pods_then_the_most_free() -> None:
    ledger = Ledger.build(inventory(16, 16, 8))
    used(ledger, 0, 2)
    used(ledger, 0, 1)  # GPU 0: two pods, 13 free
    used(ledger, 1, 10)  # GPU 1: one pod, 6 free
    used(ledger, 2, 1)  # GPU 2: one pod, 7 free
    context = PricingContext(ledger)
    (chosen,) = BALANCED.choose(judge(ledger, request(2)), request(2), context) or ()
    assert chosen.gpu.index == 2  # one pod like GPU 1, but more free
    (chosen,) = BALANCED.choose(judge(ledger, request(7)), request(7), context) or ()
    assert chosen.gpu.index == 2  # still fits there
    (chosen,) = BALANCED.choose(judge(ledger, request(8)), request(8), context) or ()
    assert chosen.gpu.index == 0  # only GPU 0 has room, however shared


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(4, 48), min_size=1, max_size=8),
    amount=st.integers(1, 4),
    count=st.integers(1, 40),
)
def test_balanced_keeps_equal_pods_within_one_of_each_other_per_gpu(sizes: list[int], amount: int, count: int) -> None:
    """Equal pods placed one by one: while every GPU has room, the pods per GPU differ by at most one; no
    GPU ever goes over its memory."""
    ledger = Ledger.build(inventory(*sizes))
    for i in range(count):
        ask = request(amount)
        choice = BALANCED.choose(judge(ledger, ask), ask, PricingContext(ledger))
        if choice is None:
            break
        ledger.add(Holding(uid=str(i), namespace="d", name=str(i), gpus={choice[0].gpu.index: amount}))
        counts = [ledger.sharers(gpu.index) for gpu in ledger.inventory.gpus]
        if all(ledger.free(gpu) >= amount for gpu in ledger.inventory.gpus):
            assert max(counts) - min(counts) <= 1, counts
        assert all(ledger.free(gpu) >= 0 for gpu in ledger.inventory.gpus)


def test_binpack_fills_a_partly_used_node_before_opening_an_empty_one() -> None:
    """A one-GPU pod that takes a whole GPU fits every empty GPU exactly: fitting the GPU alone ties an empty
    8-GPU node with a 2-GPU node half used, and kube-scheduler's own scores (least allocated) then open the
    empty node, whose eight GPUs an 8-GPU pod needed. Best fit of the node keeps it whole."""
    empty_eight = Ledger.build(inventory(*[16] * 8))
    half_two = Ledger.build(inventory(16, 16))
    used(half_two, 0, 16)
    whole = request(16)
    ranks = [appraised(ledger, whole) for ledger in (empty_eight, half_two)]
    assert node_scores(ranks) == [0, 10]
    # On the node taken, the GPU is still the tightest that fits: best fit of the GPU within the node.
    partly = Ledger.build(inventory(16, 16, 16))
    used(partly, 1, 10)
    assert BINPACK.choose(judge(partly, request(4)), request(4), PricingContext(partly))[0].gpu.index == 1  # type: ignore[index]
    # and an 8-GPU pod still finds the empty node.
    assert appraised(empty_eight, gang(16, 8)) is not None and appraised(half_two, gang(16, 8)) is None


@settings(max_examples=300, deadline=None)
@given(
    frees=st.lists(st.tuples(st.integers(1, 32), st.integers(0, 32), st.booleans()), min_size=1, max_size=8),
    amount=st.integers(1, 32),
    mps=st.booleans(),
    cpu=st.one_of(st.none(), st.tuples(st.integers(1, 96_000), st.integers(0, 96_000))),
    pod_cpu=st.integers(0, 8_000),
)
def test_pricing_only_the_tightest_gpu_chooses_and_prices_as_pricing_them_all(
    frees: list[tuple[int, int, bool]],
    amount: int,
    mps: bool,
    cpu: tuple[int, int] | None,
    pod_cpu: int,
) -> None:
    """``free_order`` lets best fit and spread price one GPU of a node instead of each: the same GPU, the same
    price as ordering every fitting GPU by (price, free, index)."""
    ledger = Ledger.build(inventory(*[size for size, _, _ in frees], mps=True))
    for index, (size, taken, shared_by_mps) in enumerate(frees):
        if taken:
            used(ledger, index, min(size, taken), mps=shared_by_mps)
    ask = request(amount, mps=mps)
    node_cpu = None if cpu is None else NodeCpu(allocatable=cpu[0], requested=min(cpu))
    for policy in (BINPACK, SPREAD):
        assert policy.free_order != 0
        every = dataclasses.replace(policy, free_order=0)
        setting = PricingContext(ledger, cpu=node_cpu, pod_cpu=pod_cpu)
        fast = policy.price_node(judge(ledger, ask), ask, setting)
        slow = every.price_node(judge(ledger, ask), ask, PricingContext(ledger, cpu=node_cpu, pod_cpu=pod_cpu))
        assert fast == slow


@settings(max_examples=400, deadline=None)
@given(
    gpus=st.lists(
        st.tuples(st.integers(1, 32), st.integers(0, 32), st.booleans(), st.booleans()), min_size=1, max_size=8
    ),
    amount=st.integers(0, 64),
    count=st.integers(1, 3),
    mps=st.booleans(),
    cpu=st.one_of(st.none(), st.tuples(st.integers(1, 96_000), st.integers(0, 96_000))),
    pod_cpu=st.integers(0, 8_000),
)
def test_appraising_the_ledger_ranks_as_pricing_every_fitting_gpu(
    *,
    gpus: list[tuple[int, int, bool, bool]],
    amount: int,
    count: int,
    mps: bool,
    cpu: tuple[int, int] | None,
    pod_cpu: int,
) -> None:
    """``Policy.appraise`` (what prioritize and the replay price) finds a one-GPU pod's GPU by one search of
    the GPUs in order of free memory: the same rank and the same GPU as pricing what ``fitting`` keeps, for
    every policy, unhealthy and MPS GPUs among them, kept through the ledger's changes."""
    inv = inventory(*[size for size, _, _, _ in gpus], mps=True)
    inv = dataclasses.replace(
        inv,
        gpus=tuple(
            dataclasses.replace(g, healthy=healthy) for g, (_, _, _, healthy) in zip(inv.gpus, gpus, strict=True)
        ),
    )
    ledger = Ledger.build(inv)
    node_cpu = None if cpu is None else NodeCpu(allocatable=cpu[0], requested=min(cpu))
    mix = RequestMix([(1000, 4, 1), (2000, 8, 2), (0, 0, 0)])
    ask = PodRequest(containers=(ContainerRequest("c0", amount, gpus=count),), mps=mps)
    for index, (size, taken, shared_by_mps, _) in enumerate(gpus):
        for policy in (BINPACK, SPREAD, FGD, BALANCED):
            context = PricingContext(ledger, mix=mix, cpu=node_cpu, pod_cpu=pod_cpu)
            every = policy.price_node(fitting(ledger, ask), ask, context)
            assert policy.appraise(ledger, ask, context) == every
        if taken:  # the next round on a ledger that changed: what is kept on it must follow
            used(ledger, index, min(size, taken), mps=shared_by_mps)


def test_fgd_keeps_the_few_nodes_a_big_kind_fits_for_it() -> None:
    """One pod in a thousand needs 8 GPUs and 120 CPUs, which only the one 128-CPU node of 39 can host. At its
    share alone, breaking that node grows the fragment by 0.008 GPU, within one of fgd's levels, and the
    small pod went wherever CPU and GPU stayed balanced: the big node. Knowing the cluster's nodes, the
    big kind weighs 39 times on the one node that can host it, and the small pod goes elsewhere."""
    big = NodeClass(model="Fake GPU", gpus=8, gpu_memory=16, cpu=128_000)
    plain = big._replace(cpu=96_000)
    kinds = [(4000, 4, 1)] * 599 + [(1000, 0, 0)] * 400 + [(120_000, 16, 8)]
    req = request(4)

    def ranks(mix: RequestMix) -> list[NodeRank | None]:
        keys = []
        for node in (big, plain):
            ledger = Ledger.build(inventory(*[16] * 8))
            context = PricingContext(ledger, mix=mix, cpu=NodeCpu(node.cpu or 0, 0), pod_cpu=4000, model=node.model)
            keys.append(appraised(ledger, req, context, FGD))
        return keys

    blind = ranks(RequestMix(kinds))
    assert blind[0] and blind[1] and blind[0].price == blind[1].price  # the same level on both
    assert node_scores(blind) == [10, 9]  # and the big node is the better balanced
    assert node_scores(ranks(RequestMix(kinds, nodes={big: 1, plain: 38}))) == [0, 10]
    assert RequestMix(kinds, nodes={big: 1, plain: 38}).for_node(plain).fragment([16] * 8, cpu_free=96_000) == (
        RequestMix(kinds).fragment([16] * 8, cpu_free=96_000)  # a kind every node could host weighs as before
    )
