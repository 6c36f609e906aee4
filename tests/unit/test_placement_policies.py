"""What each policy prefers: fgd's growth of fragmentation, balanced, binpack, and pricing by the ledger."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.contract import ContractError, GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.placement.fragmentation import NodeClass, RequestMix
from gpushared.core.placement.mixbook import EXPECTED_WEIGHT, ExpectedMix, MixBook
from gpushared.core.placement.policies import (
    BALANCED,
    BINPACK,
    FGD,
    FGD_WHOLE_UNTIL,
    SPREAD,
    NodeRank,
    node_scores,
    policy_named,
)
from gpushared.core.placement.pricing import NodeCpu, PricingContext
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.core.shared.verdicts import fitting, idle_gpu_mib, judge
from tests.builders import inventory
from tests.placing import appraised, gang, mix_of, request, used


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


@pytest.mark.parametrize(
    ("pods_seen", "scores"),
    [
        (0, [9, 10]),  # no mix at all: the untouched node last
        (10, [9, 10]),  # a young mix, of small pods only: it knows no kind that needs the big node whole
        (int(FGD_WHOLE_UNTIL) - 1, [9, 10]),
        (int(FGD_WHOLE_UNTIL), [10, 9]),  # the mix has seen enough: balance decides among equal growths
        (5000, [10, 9]),
    ],
)
def test_fgd_keeps_untouched_nodes_for_last_while_its_mix_is_young(pods_seen: int, scores: list[int]) -> None:
    """Equal growths: an untouched 8-GPU node would be left better balanced than a 2-GPU node half used, but
    while the mix knows of fewer than FGD_WHOLE_UNTIL pods, fgd keeps the untouched node for the big kinds it
    has not seen yet (issue #56)."""
    big, small = Ledger.build(inventory(*[16] * 8)), Ledger.build(inventory(16, 16))
    used(small, 0, 8)
    mix = RequestMix.of_counts({(2000, 4, 1): pods_seen}) if pods_seen else RequestMix()
    settings = [
        PricingContext(big, mix=mix, cpu=NodeCpu(allocatable=128_000, requested=0), pod_cpu=2000),
        PricingContext(small, mix=mix, cpu=NodeCpu(allocatable=16_000, requested=0), pod_cpu=2000),
    ]
    assert [s.growth(judge(s.ledger, request(4))[:1], 4) for s in settings] == [0.0, 0.0]
    assert [round(s.imbalance(4), 3) for s in settings] == [0.016, 0.25]
    assert node_scores([appraised(s.ledger, request(4), s, FGD) for s in settings]) == scores


def test_an_expected_mix_of_the_default_weight_leaves_fgd_as_it_was() -> None:
    """The untouched-last rule is for a fresh extender: an expected mix counts as EXPECTED_WEIGHT pods from
    the start, so with one fgd never applies it, and the replay's figures with the expected mix stay
    byte-identical."""
    assert FGD_WHOLE_UNTIL <= EXPECTED_WEIGHT
    book = MixBook(ExpectedMix.of_counts({(2000, 4, 1, None): 3, (8000, 16, 8, None): 1}))
    assert len(book.take(nodes={})) >= FGD_WHOLE_UNTIL


def test_policy_names() -> None:
    assert policy_named("binpack") is BINPACK
    with pytest.raises(ContractError, match="unknown placement policy; choose one of binpack, spread, fgd"):
        policy_named("random")


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
