"""Which GPU models a kind of pod may use, and fgd weighing that (issue #25): the tasks pinned to a scarce
model must find it free of tasks that could have run anywhere."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared import contract
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.placement.fragmentation import NodeClass, NodeRoom, RequestMix, hosts, hosts_now, node_room
from gpushared.core.placement.policies import (
    BINPACK,
    BINPACK_PRESSURE,
    FGD,
    FGD_PRESSURE,
    NodeRank,
    Policy,
    node_scores,
)
from gpushared.core.placement.pricing import NodeCpu, PricingContext
from gpushared.core.shared.bodies import gpu_models, slim_pod
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest, pod_request
from gpushared.core.shared.verdicts import judge
from gpushared.extender.cache import ClusterCache
from tests.builders import inventory, pod
from tests.extender_harness import gpu_node

LABEL = "nvidia.com/gpu.product"


def affinity(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": list(term)} for term in terms]
            }
        }
    }


def expression(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, "values": list(values)}


# spec fields -> the models allowed
CASES: dict[str, tuple[dict[str, Any], frozenset[str] | None]] = {
    "nothing said": ({}, None),
    "nodeSelector": ({"nodeSelector": {LABEL: "Tesla-T4"}}, frozenset({"Tesla-T4"})),
    "another label only": ({"nodeSelector": {"zone": "a"}}, None),
    "affinity In": ({"affinity": affinity([expression(LABEL, "In", "A100", "V100")])}, frozenset({"A100", "V100"})),
    "terms are alternatives": (
        {"affinity": affinity([expression(LABEL, "In", "A100")], [expression(LABEL, "In", "T4")])},
        frozenset({"A100", "T4"}),
    ),
    "a term free of the label frees all": (
        {"affinity": affinity([expression(LABEL, "In", "A100")], [expression("zone", "In", "a")])},
        None,
    ),
    "expressions of one term all hold": (
        {"affinity": affinity([expression(LABEL, "In", "A100", "T4"), expression(LABEL, "In", "T4", "V100")])},
        frozenset({"T4"}),
    ),
    "NotIn depends on the cluster": ({"affinity": affinity([expression(LABEL, "NotIn", "T4")])}, None),
    "selector and affinity both hold": (
        {"nodeSelector": {LABEL: "T4"}, "affinity": affinity([expression(LABEL, "In", "A100", "T4")])},
        frozenset({"T4"}),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_gpu_models(case: str) -> None:
    spec, expected = CASES[case]
    body = pod("p", 4)
    body["spec"].update(spec)
    assert gpu_models(body, LABEL) == expected
    assert gpu_models(slim_pod(body), LABEL) == expected  # the extender's cache keeps what it needs
    assert gpu_models(body, "") is None


def test_a_kind_pinned_elsewhere_uses_none_of_a_nodes_memory() -> None:
    mix = RequestMix([(1000, 16, 1, frozenset({"T4"})), (1000, 4, 1, None)])
    assert mix.for_model(None) is mix and RequestMix([(1000, 4, 1)]).for_model("T4").fragment([16]) == 0.0
    # On a G2 node the T4-pinned half of the mix can use nothing: all 16 free are fragment to it.
    assert mix.for_model("G2").fragment([16]) == pytest.approx(8.0)
    assert mix.for_model("T4").fragment([16]) == pytest.approx(0.0)


def test_fgd_keeps_a_scarce_model_for_the_pods_pinned_to_it() -> None:
    """A flexible 4 GiB pod, a T4 node and a G2 node with the same free memory and CPU; half the pods seen
    must have a whole T4. Model-blind, the nodes are equal; weighed, fgd sends the pod to the G2 node."""
    mix = RequestMix([(1000, 16, 1, frozenset({"T4"})), (1000, 4, 1, None)])
    req = PodRequest(containers=(ContainerRequest("c0", 4),))
    ranks = {}
    for model in (None, "with"):
        ranks[model] = []
        for node_model in ("T4", "G2"):
            ledger = Ledger.build(inventory(16, 16))
            context = PricingContext(
                ledger,
                mix=mix,
                cpu=NodeCpu(allocatable=32000, requested=0),
                pod_cpu=1000,
                model=node_model if model else None,
            )
            found = FGD.price_node(judge(ledger, req), req, context)
            assert found is not None
            ranks[model].append(found[0])
    assert node_scores(ranks[None]) == [10, 10]
    assert node_scores(ranks["with"]) == [0, 10]


def test_the_extender_counts_kinds_with_their_models_and_nodes_with_theirs() -> None:
    cache = ClusterCache(
        list_nodes=lambda **_: None,
        list_pods=lambda **_: None,
        resources=contract.DEFAULT_RESOURCES,
        model_label=LABEL,
    )
    t4 = gpu_node("t4", 16)
    t4["metadata"]["labels"] = {LABEL: "T4"}
    cache.on_node(None, t4)
    pinned = pod("pinned", 16, node="t4")
    pinned["spec"]["nodeSelector"] = {LABEL: "T4"}
    cache.on_pod(None, pinned)
    assert cache.state.nodes["t4"].model == "T4"
    mix = cache.state.request_mix()
    # The only kind seen may use T4s alone: to a G2 node all its memory is fragment, to a T4 none of it.
    assert mix.for_model("G2").fragment([16]) == pytest.approx(16.0)
    assert mix.for_model("T4").fragment([16]) == pytest.approx(0.0)
    # And the nodes by class, for how scarce each kind's hosts are: one T4 node of one 16 GiB GPU.
    (seen,) = mix.nodes
    assert (seen.model, seen.gpus, seen.gpu_memory, mix.nodes[seen]) == ("T4", 1, 16, 1)
    # Counted again when a node's shape changes, not with every mix: a status update alone changes nothing.
    counted = cache.state._node_classes()
    cache.on_node(t4, t4)
    assert cache.state._node_classes() is counted
    g2 = gpu_node("g2", 16, 16)
    g2["metadata"]["labels"] = {LABEL: "G2"}
    cache.on_node(None, g2)
    assert sorted((c.model, c.gpus, n) for c, n in cache.state._node_classes().items()) == [("G2", 2, 1), ("T4", 1, 1)]


T4 = NodeClass(model="T4", gpus=2, gpu_memory=16, cpu=96_000)


@pytest.mark.parametrize(
    ("kind", "hosted"),
    [
        ((4000, 8, 1, None), True),
        ((4000, 8, 1, frozenset({"T4", "G2"})), True),
        ((4000, 8, 1, frozenset({"G2"})), False),  # pinned to another model
        ((4000, 16, 4, None), False),  # more GPUs than the node has
        ((4000, 24, 1, None), False),  # more memory than its GPUs have
        ((120_000, 8, 1, None), False),  # more CPU than pods may request there
        ((96_000, 16, 2, None), True),
    ],
)
def test_which_node_classes_could_host_a_kind(kind: tuple[int, int, int, frozenset[str] | None], hosted: bool) -> None:
    assert hosts(T4, kind) is hosted
    assert hosts(T4._replace(model=None, cpu=None), kind) is (kind[1] <= 16 and kind[2] <= 2)  # unknown: not refused


def test_a_kind_weighs_on_the_nodes_that_could_host_it_by_how_few_they_are() -> None:
    g2 = NodeClass(model="G2", gpus=8, gpu_memory=16, cpu=96_000)
    kinds = [(4000, 8, 1, frozenset({"T4"}))] * 10 + [(4000, 8, 1, None)] * 90
    mix = RequestMix(kinds, nodes={T4: 10, g2: 30})
    # On a T4 node the T4-only kind weighs 10 pods x 40 nodes / 10 that could host it, the other 90 x 1: a
    # GPU with 4 free, which neither can use, is 130 % fragment (shares of the 100 pods seen).
    assert mix.for_node(T4).fragment([4], cpu_free=8000) == pytest.approx(1.3 * 4)
    # On a G2 node the T4-only kind can use nothing, as for_model says, and the other weighs as it is.
    assert mix.for_node(g2).fragment([16], cpu_free=8000) == pytest.approx(0.1 * 16)
    blind = RequestMix(kinds)  # the cluster's nodes not known: the model's view
    assert blind.for_node(T4) is blind.for_model("T4")


G2 = NodeClass(model="G2", gpus=8, gpu_memory=16, cpu=96_000)


@pytest.mark.parametrize(
    ("kinds", "nodes", "pressures"),
    [
        # 10 pods pinned to T4, each half a T4, on 10 T4 nodes of 2 GPUs: 5 of 20 T4 GPUs wanted
        ([(4000, 8, 1, frozenset({"T4"}))] * 10, {T4: 10, G2: 30}, {"T4": 0.25, "G2": 0.0}),
        # a pod on 2 whole GPUs allowed on both models the cluster has is not pinned at all
        ([(4000, 16, 2, frozenset({"T4", "G2"}))] * 10, {T4: 10, G2: 30}, {"T4": 0.0, "G2": 0.0}),
        # allowed on T4 and a model the cluster lacks: all of it on the T4s; 2 whole GPUs each
        ([(4000, 16, 2, frozenset({"T4", "V100"}))] * 5, {T4: 10, G2: 30}, {"T4": 0.5, "G2": 0.0}),
        # allowed on two of three models: split evenly between them
        (
            [(4000, 16, 1, frozenset({"T4", "G2"}))] * 20,
            {T4: 10, G2: 5, G2._replace(model="A10"): 1},
            {"T4": 0.5, "G2": 0.25, "A10": 0.0},
        ),
        # pods without GPU and pods that may run anywhere press on nothing
        ([(4000, 0, 0, None), (4000, 8, 1, None)] * 10, {T4: 10, G2: 30}, {"T4": 0.0, "G2": 0.0}),
        # the cluster's nodes not known: no pressure (nothing to divide by)
        ([(4000, 8, 1, frozenset({"T4"}))] * 10, {}, {"T4": 0.0}),
    ],
)
def test_pressure_of_pinned_pods_on_each_gpu_model(
    kinds: list[tuple[int, int, int, frozenset[str] | None]],
    nodes: dict[NodeClass, int],
    pressures: dict[str, float],
) -> None:
    mix = RequestMix(kinds, nodes=nodes)
    assert {model: mix.pressure(model) for model in pressures} == pytest.approx(pressures)
    assert mix.pressure(None) == 0.0  # a node whose model is not known


A10 = G2._replace(model="A10")


@pytest.mark.parametrize(
    ("kinds", "nodes", "projected"),
    [
        # 2 of 100 pods pinned to T4, all half a GPU: 2 % of the demand, 260 GPUs in all, 20 of them T4:
        # a full cluster's pinned pods would want 0.02 x 260 / 20 of the T4s (the count alone says 1 of 20)
        (
            [(4000, 8, 1, frozenset({"T4"}))] * 2 + [(4000, 8, 1, None)] * 98,
            {T4: 10, G2: 30},
            {"T4": 0.26, "G2": 0.0},
        ),
        # 20 of 200 whole-GPU pods allowed on two of three models: 5 % of the demand on each of the two
        (
            [(4000, 16, 1, frozenset({"T4", "G2"}))] * 20 + [(4000, 16, 1, None)] * 180,
            {T4: 10, G2: 5, A10: 1},
            {"T4": 0.05 * 68 / 20, "G2": 0.05 * 68 / 40, "A10": 0.0},
        ),
        # pods without GPU count for no demand: the same 2 % as the first, beside 1,000 CPU pods
        (
            [(4000, 8, 1, frozenset({"T4"}))] * 2 + [(4000, 8, 1, None)] * 98 + [(4000, 0, 0, None)] * 1000,
            {T4: 10, G2: 30},
            {"T4": 0.26, "G2": 0.0},
        ),
        # every GPU pod pinned to T4: more than the T4s hold, so all of them (never above 1)
        ([(4000, 8, 1, frozenset({"T4"}))] * 10, {T4: 10, G2: 30}, {"T4": 1.0, "G2": 0.0}),
        # no pod pinned, or the cluster's nodes not known: none
        ([(4000, 8, 1, None)] * 10, {T4: 10, G2: 30}, {"T4": 0.0, "G2": 0.0}),
        ([(4000, 8, 1, frozenset({"T4"}))] * 10, {}, {"T4": 0.0}),
    ],
)
def test_projected_pressure_follows_the_pinned_share_of_the_demand(
    kinds: list[tuple[int, int, int, frozenset[str] | None]],
    nodes: dict[NodeClass, int],
    projected: dict[str, float],
) -> None:
    """What fgd keeps pinned models by (issue #56): the pinned pods' share of the GPU demand seen, over
    the model's share of the cluster's GPUs. It does not wait for the pinned pods to arrive in numbers."""
    mix = RequestMix(kinds, nodes=nodes)
    assert {model: mix.projected_pressure(model) for model in projected} == pytest.approx(projected)
    assert mix.projected_pressure(None) == 0.0
    # the same share of a mix ten times as large presses as much
    larger = RequestMix(kinds * 10, nodes=nodes)
    assert {model: larger.projected_pressure(model) for model in projected} == pytest.approx(projected)


@pytest.mark.parametrize(("policy", "weight"), [(BINPACK, BINPACK_PRESSURE), (FGD, FGD_PRESSURE)])
def test_a_pod_that_may_run_anywhere_is_kept_off_the_model_pinned_pods_need(policy: Policy, weight: float) -> None:
    """An empty T4 node of 2 GPUs and an empty G2 node of 8, while the pods pinned to T4 want every T4 of
    the cluster. A 4 GiB pod that may run anywhere goes to the G2 node, though best fit alone takes the
    smaller T4 node; a pod pinned to T4 is priced without the pressure (it has nowhere else to go)."""
    kinds = [(1000, 16, 1, frozenset({"T4"}))] * 40 + [(1000, 4, 1, None)] * 40
    mix = RequestMix(kinds, nodes={T4: 20, G2: 20})
    assert mix.pressure("T4") == pytest.approx(1.0) and mix.pressure("G2") == 0.0
    req = PodRequest(containers=(ContainerRequest("c0", 4),))

    def ranks(*, pinned: bool) -> list[NodeRank | None]:
        found = []
        for model, ledger in (("T4", Ledger.build(inventory(16, 16))), ("G2", Ledger.build(inventory(*[16] * 8)))):
            cpu = NodeCpu(allocatable=96_000, requested=0)
            context = PricingContext(ledger, mix=mix, cpu=cpu, pod_cpu=1000, model=model, pinned=pinned)
            appraised = policy.price_node(judge(ledger, req), req, context)
            found.append(None if appraised is None else appraised[0])
        return found

    free, pinned = ranks(pinned=False), ranks(pinned=True)
    assert free[0] is not None and pinned[0] is not None
    assert free[0].price == pytest.approx(pinned[0].price + weight * 1.0)  # the T4's pressure, weighed
    assert free[1] == pinned[1]  # the G2 is pressed by no one
    assert node_scores(free) == [0, 10]
    if policy is BINPACK:
        assert node_scores(pinned) == [10, 0]  # best fit of the node alone: the smaller T4 node


@pytest.mark.parametrize(
    ("t4_free", "g2_free", "projected"),
    [
        # every GPU free: as without rooms, 0.02 x 260 / 20
        (16, 16, 0.26),
        # the T4s half full, the G2s untouched: 250 GPUs left, 10 of them T4
        (8, 16, 0.02 * 250 / 10),
        # the G2s half full, the T4s untouched: 140 left, 20 of them T4
        (16, 8, 0.02 * 140 / 20),
        # no T4 left: all of it wanted
        (0, 16, 1.0),
    ],
)
def test_projected_pressure_weighs_what_each_model_has_left(t4_free: int, g2_free: int, projected: float) -> None:
    """A model filled faster than the cluster is pressed harder: the pinned share of the GPUs left in the
    cluster, over the model's GPUs left (the rooms a recount tells the mix)."""
    kinds = [(4000, 8, 1, frozenset({"T4"}))] * 2 + [(4000, 8, 1, None)] * 98
    rooms = {
        node_room([t4_free] * 2, model="T4", cpu_free=96_000): 10,
        node_room([g2_free] * 8, model="G2", cpu_free=96_000): 30,
    }
    mix = RequestMix(kinds, nodes={T4: 10, G2: 30}, rooms=rooms)
    assert mix.projected_pressure("T4") == pytest.approx(projected)
    assert mix.projected_pressure("G2") == 0.0
    # the counted pressure reads no rooms: 1 GPU of the 20 T4s wanted, full or not
    assert mix.pressure("T4") == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("policy", "added"),
    [
        # binpack's strict order needs only that some pinned pod was seen: the count (2 pods, 1 of 20 GPUs)
        (BINPACK, BINPACK_PRESSURE * 0.05),
        # fgd weighs the pressure against its fragment's levels: what the share says a full cluster wants
        (FGD, FGD_PRESSURE * 0.26),
    ],
)
def test_fgd_prices_the_projected_pressure_and_binpack_the_counted(policy: Policy, added: float) -> None:
    """2 of 100 pods seen are pinned to T4 (the first case of the table above): a pod that may run
    anywhere pays for a T4 what each policy's pressure says, and a pinned pod nothing."""
    kinds = [(1000, 8, 1, frozenset({"T4"}))] * 2 + [(1000, 8, 1, None)] * 98
    mix = RequestMix(kinds, nodes={T4: 10, G2: 30})
    req = PodRequest(containers=(ContainerRequest("c0", 4),))
    ledger = Ledger.build(inventory(16, 16))
    prices = []
    for pinned in (False, True):
        cpu = NodeCpu(allocatable=96_000, requested=0)
        context = PricingContext(ledger, mix=mix, cpu=cpu, pod_cpu=1000, model="T4", pinned=pinned)
        appraised = policy.price_node(judge(ledger, req), req, context)
        assert appraised is not None
        prices.append(appraised[0].price)
    assert prices[0] - prices[1] == pytest.approx(added)


def test_a_kind_weighs_by_the_nodes_that_could_host_it_now() -> None:
    """As the cluster fills, the few nodes left with room for a big kind weigh it more."""
    node = NodeClass(model="G2", gpus=8, gpu_memory=16, cpu=96_000)
    kinds = [(8000, 16, 8, None)] * 1 + [(4000, 4, 1, None)] * 99
    empty = node_room([16] * 8, model="G2", cpu_free=96_000)
    half = node_room([8] * 8, model="G2", cpu_free=48_000)
    static = RequestMix(kinds, nodes={node: 4})
    now = static.with_rooms({empty: 1, half: 3})
    assert static.rooms is None and now.nodes == static.nodes
    # An empty GPU of 16: the 8-GPU kind (share 1 %) cannot use it on a node that has fewer than 8 with room.
    # Every node could host that kind when empty (weight 1); now only one of the four can (weight 4).
    assert static.for_node(node).fragment([16] * 7 + [8], cpu_free=96_000) == pytest.approx(0.01 * 120)
    assert now.for_node(node).fragment([16] * 7 + [8], cpu_free=96_000) == pytest.approx(0.04 * 120)
    # No node with room for it now weighs as if one had, never as zero nodes.
    assert static.with_rooms({half: 4}).for_node(node).fragment([16] * 7 + [8], cpu_free=96_000) == pytest.approx(
        0.04 * 120
    )


def test_fgd_keeps_the_last_empty_node_for_the_big_kind() -> None:
    """The gpushare60 failure mode (issue #25): 40 nodes of 8 GPUs that could all host an 8-GPU task when
    empty, of which 39 already hold small pods. A small pod priced against the nodes as they could be (every
    one a host: the 8-GPU kind at its share alone) sees breaking the last empty node as within one of fgd's
    levels, and the empty node is the better balanced: it takes it, and the next 8-GPU task fails. Priced
    against what the nodes have left now, the kind weighs 40 times on the one node that can still take it,
    and the small pod goes to a node already broken."""
    g2 = NodeClass(model="G2", gpus=8, gpu_memory=16, cpu=96_000)
    kinds = [(4000, 4, 1, None)] * 599 + [(1000, 0, 0, None)] * 400 + [(64_000, 16, 8, None)]
    broken = [16] * 7 + [8]
    rooms = {node_room([16] * 8, model="G2", cpu_free=96_000): 1, node_room(broken, model="G2", cpu_free=88_000): 39}
    req = PodRequest(containers=(ContainerRequest("c0", 4),))

    def ranks(mix: RequestMix) -> list[NodeRank | None]:
        found = []
        for frees, cpu_used in (([16] * 8, 0), (broken, 8000)):
            ledger = Ledger.build(inventory(*[16] * 8))
            if frees == broken:
                ledger.add(Holding(uid="small", namespace="default", name="small", gpus={7: 8}))
            context = PricingContext(ledger, mix=mix, cpu=NodeCpu(96_000, cpu_used), pod_cpu=4000, model="G2")
            appraised = FGD.price_node(judge(ledger, req), req, context)
            found.append(None if appraised is None else appraised[0])
        return found

    static = RequestMix(kinds, nodes={g2: 40})
    assert node_scores(ranks(static)) == [10, 9]  # the same level; the empty node the better balanced
    assert node_scores(ranks(static.with_rooms(rooms))) == [0, 10]


def _hosts_now_by_hand(rooms: dict[NodeRoom, int], kind: tuple[int, int, int, frozenset[str] | None]) -> int:
    cpu, size, gpus, models = kind
    return sum(
        n
        for room, n in rooms.items()
        if (models is None or room.model is None or room.model in models)
        and (room.cpu is None or cpu <= room.cpu)
        and sum(1 for free in room.frees if free >= size) >= max(gpus, 1)
    )


MODELS = st.sampled_from(["T4", "V100", None])
ROOMS = st.dictionaries(
    st.builds(
        node_room,
        st.lists(st.integers(0, 32), min_size=1, max_size=8),
        model=MODELS,
        cpu_free=st.one_of(st.none(), st.integers(0, 64_000)),
    ),
    st.integers(1, 5),
    max_size=12,
)
KINDS = st.lists(
    st.tuples(
        st.integers(0, 64_000),
        st.integers(1, 32),
        st.sampled_from([1, 2, 4, 8]),
        st.one_of(st.none(), st.frozensets(st.sampled_from(["T4", "V100", "A100"]), min_size=1)),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(rooms=ROOMS, kinds=KINDS)
def test_hosts_now_counts_what_every_node_checked_by_hand_would(
    rooms: dict[NodeRoom, int], kinds: list[tuple[int, int, int, frozenset[str] | None]]
) -> None:
    counted = hosts_now(rooms, kinds)
    assert counted == {kind: _hosts_now_by_hand(rooms, kind) for kind in kinds}


def test_the_extender_tells_the_mix_what_each_node_has_left() -> None:
    cache = ClusterCache(
        list_nodes=lambda **_: None,
        list_pods=lambda **_: None,
        resources=contract.DEFAULT_RESOURCES,
        model_label=LABEL,
    )
    node = gpu_node("n1", 16, 16)
    node["metadata"]["labels"] = {LABEL: "G2"}
    cache.on_node(None, node)
    first = cache.state._node_rooms()
    assert [(room.model, room.frees) for room in first] == [("G2", (16, 16))]
    bound = pod("p", 6, node="n1", phase="Running")
    inventory = cache.state.nodes["n1"].inventory
    assert inventory is not None
    bound["metadata"]["annotations"] = bind_annotations(
        pod_request(bound), inventory.gpus[1:], unit=inventory.unit, now_ns=1
    )
    cache.on_pod(None, bound)
    (room,) = cache.state._node_rooms()
    assert (room.model, room.frees) == ("G2", (16, 10))
    assert cache.state.request_mix().rooms == {room: 1}
