"""What a node's rank is kept for in the index's memos, and when it is worked out again: a new mix (every
MIX_SECONDS) drops only what read it, the pressures only what read them, a node's CPU only what reads CPU;
given ``cold``, a call prices a turn's worth and names the rest (issue #52)."""

from __future__ import annotations

import dataclasses

from gpushared.core.placement.binding import bind_annotations
from gpushared.core.placement.policies import BINPACK, Policy
from gpushared.core.placement.pricing import NodeCpu, PricingContext
from gpushared.core.shared.ledger import GpuVerdict
from gpushared.core.shared.requests import pod_request
from gpushared.extender import index as index_module
from gpushared.extender.state import MIX_SECONDS
from tests.builders import inventory, pod
from tests.extender_harness import fed_by_hand, gpu_node

INVENTORY = inventory(16, 16)


def test_prices_that_do_not_read_the_mix_outlive_a_new_mix() -> None:
    """Each new mix (every MIX_SECONDS) would otherwise price every node again for every request size: the
    prioritize calls that pay for it are binpack's slowest, for nothing."""
    now = [0.0]
    cache = fed_by_hand(clock=lambda: now[0])
    cache.on_node(None, gpu_node("n1", inv=INVENTORY))
    request = pod_request(pod("probe", 3))
    priced: list[int] = []

    def cost(verdict: GpuVerdict, need: int, setting: PricingContext) -> float:
        priced.append(verdict.free)
        return float(verdict.free - need)

    for reads_mix in (False, True):
        policy = Policy(name=f"counting-{reads_mix}", price=cost, reads_mix=reads_mix)
        cache.index.node_ranks(["n1"], pod("probe"), request, policy)
        assert priced
        priced.clear()
        now[0] += MIX_SECONDS
        cache.index.node_ranks(["n1"], pod("probe"), request, policy)
        assert bool(priced) == reads_mix
        priced.clear()


def test_a_call_given_cold_prices_a_turns_worth_and_names_the_rest() -> None:
    """A new mix (every MIX_SECONDS) prices every node again for each size: given ``cold``, a call prices at
    most PRICES_PER_TURN of them and names the others, answered None, for the caller to price over the next
    turns of the event loop (``Scheduler.paced``); asked again, it answers every node as one call pricing
    them all would."""
    now = [0.0]
    cache = fed_by_hand(clock=lambda: now[0])
    names = [f"n{i:03}" for i in range(2 * index_module.PRICES_PER_TURN + 20)]
    for name in names:
        cache.on_node(None, gpu_node(name, inv=INVENTORY))
    priced: set[tuple[int, int]] = set()  # (the node's ledger, the mix it was priced under)

    def by_mix(verdict: GpuVerdict, need: int, setting: PricingContext) -> float:
        priced.add((id(setting.ledger), cache.state.mix_generation))
        return float(cache.state.mix_generation)

    policy = Policy(name="by-mix", price=by_mix, reads_mix=True)
    probe, request = pod("probe", 3), pod_request(pod("probe", 3))
    cache.index.node_ranks(names, probe, request, policy)
    assert len(priced) == len(names)
    now[0] += MIX_SECONDS
    priced.clear()
    cold: list[str] = []
    ranks = cache.index.node_ranks(names, probe, request, policy, cold=cold)
    turn = index_module.PRICES_PER_TURN
    assert len(priced) == turn and {mix for _, mix in priced} == {cache.state.mix_generation}
    assert cold == names[turn:] and ranks[turn:] == [None] * len(cold) and None not in ranks[:turn]
    cache.index.node_ranks(cold, probe, request, policy)  # what the caller does over the next turns
    priced.clear()
    again: list[str] = []
    ranks = cache.index.node_ranks(names, probe, request, policy, cold=again)
    assert not again and not priced
    fresh = dataclasses.replace(policy, name="by-mix-fresh")
    assert ranks == [cache.index.node_ranks([name], probe, request, fresh)[0] for name in names]


def test_prices_that_read_only_the_pressures_outlive_a_new_mix_until_the_pressures_move() -> None:
    """binpack reads the mix only for the pressure pinned pods put on GPU models: where none is pinned a new
    mix (every MIX_SECONDS) changes none of its prices, and pricing every node again for every request size
    after each count made the next calls of each size the slowest. A pinned pod counted moves the pressures:
    then the prices are worked out again, and differ."""
    label = "example.com/gpu-model"
    now = [0.0]
    cache = fed_by_hand(clock=lambda: now[0], model_label=label)
    for name, model in (("t4", "T4"), ("g2", "G2")):
        node = gpu_node(name, inv=INVENTORY, cpu="8")
        node["metadata"]["labels"] = {label: model}
        cache.on_node(None, node)
    names = {id(cache.state.nodes[name].ledger): name for name in ("t4", "g2")}
    probe, request = pod("probe", 3), pod_request(pod("probe", 3))
    priced: set[tuple[str, float]] = set()  # (node, the pressure it was priced under)

    def cost(verdict: GpuVerdict, need: int, setting: PricingContext) -> float:
        priced.add((names[id(setting.ledger)], setting.pressure))
        return float(verdict.free - need) + setting.pressure

    policy = Policy(name="counting-pressure", price=cost, reads_pressure=True)
    first = cache.index.node_ranks(["t4", "g2"], probe, request, policy)
    assert priced == {("t4", 0.0), ("g2", 0.0)}
    for _ in range(3):  # new mixes, the same (no) pressures: every price kept
        priced.clear()
        now[0] += MIX_SECONDS
        assert cache.index.node_ranks(["t4", "g2"], probe, request, policy) == first
        assert not priced
    pinned = pod("pinned", 8, node="t4", phase="Running")
    pinned["spec"]["nodeSelector"] = {label: "T4"}
    pinned["metadata"]["annotations"] = bind_annotations(
        pod_request(pinned), INVENTORY.gpus[:1], unit=INVENTORY.unit, now_ns=1
    )
    cache.on_pod(None, pinned)
    priced.clear()
    cache.index.node_ranks(["t4", "g2"], probe, request, policy)
    assert priced == {("t4", 0.0)}  # its ledger changed; the mix is taken at most every MIX_SECONDS
    priced.clear()
    now[0] += MIX_SECONDS
    moved = cache.index.node_ranks(["t4", "g2"], probe, request, policy)
    assert {node for node, _ in priced} == {"t4", "g2"}  # the pressures moved: every node priced again
    assert dict(priced)["t4"] > 0 and dict(priced)["g2"] == 0.0
    assert moved[1] == first[1]
    # A pod pinned itself is priced without pressure.
    priced.clear()
    mine = pod("mine", 3)
    mine["spec"]["nodeSelector"] = {label: "T4"}
    cache.index.node_ranks(["t4"], mine, request, policy)
    assert priced == {("t4", 0.0)}


def test_binpacks_ranks_outlive_a_new_mix_where_no_pod_is_pinned() -> None:
    """The shipped policy: its ranked filter and prioritize no longer price every node again every
    MIX_SECONDS (they did while binpack counted as reading the whole mix)."""
    now = [0.0]
    cache = fed_by_hand(clock=lambda: now[0])
    for name in ("n1", "n2"):
        cache.on_node(None, gpu_node(name, inv=INVENTORY, cpu="8"))
    cache.on_pod(None, pod("kind", 5, node="n1", phase="Running"))
    request = pod_request(pod("probe", 3))
    priced: list[int] = []
    binpack = dataclasses.replace(BINPACK, price=lambda *args: priced.append(1) or BINPACK.price(*args))
    first = cache.index.node_ranks(["n1", "n2"], pod("probe", 3), request, binpack)
    assert len(priced) == 2
    now[0] += MIX_SECONDS
    assert cache.index.node_ranks(["n1", "n2"], pod("probe", 3), request, binpack) == first
    assert cache.state.mix_generation >= 2 and len(priced) == 2


def test_prices_that_read_cpu_are_kept_per_pod_cpu_and_until_the_nodes_cpu_changes() -> None:
    """A pod without GPU arriving on a node changes no ledger but changes what fgd weighs there; binpack's
    prices do not read it and are kept."""
    cache = fed_by_hand()
    cache.on_node(None, gpu_node("n1", inv=INVENTORY, cpu="8"))
    request = pod_request(pod("probe", 3))
    priced: list[PricingContext] = []  # each node pricing, by the setting its costs were given

    def cost(verdict: GpuVerdict, need: int, setting: PricingContext) -> float:
        if not priced or priced[-1] is not setting:
            priced.append(setting)
        return float(verdict.free - need)

    for reads_cpu in (False, True):
        policy = Policy(name=f"counting-{reads_cpu}", price=cost, reads_cpu=reads_cpu)
        for cpu in ("1", "1", "2"):
            cache.index.node_ranks(["n1"], pod("probe", 3, cpu=cpu), request, policy)
        assert [s.pod_cpu for s in priced] == ([1000, 2000] if reads_cpu else [0])
        priced.clear()
        cache.on_pod(None, pod(f"cpu-only-{reads_cpu}", node="n1", cpu="1", phase="Running"))
        cache.index.node_ranks(["n1"], pod("probe", 3, cpu="2"), request, policy)
        assert [s.pod_cpu for s in priced] == ([2000] if reads_cpu else [])
        assert not reads_cpu or priced[0].cpu == NodeCpu(allocatable=8000, requested=2000)
        priced.clear()
