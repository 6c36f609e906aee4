"""A verb that ranks nodes prices them PRICES_PER_TURN per turn of the event loop, then answers in one turn
from their memos (issue #52: the first call of a size, or the first after a new mix, priced a thousand
nodes in one turn and held every other verb for 0.2-0.5 s under a large expected mix). The answer is the
one the verb gives in one go."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest

from gpushared import contract
from gpushared.core.placement.policies import Policy, policy_named
from gpushared.core.placement.pricing import PricingContext
from gpushared.core.shared.ledger import GpuVerdict
from gpushared.extender import scheduler as scheduler_module
from gpushared.extender.cache import ClusterCache
from gpushared.extender.http.wire import ExtenderArgs
from gpushared.extender.index import PRICES_PER_TURN
from gpushared.extender.scheduler import Scheduler
from tests.builders import inventory, pod
from tests.extender_harness import fed_by_hand, gpu_node

NODES = 3 * PRICES_PER_TURN + 7


def a_cluster(seed: int) -> ClusterCache:
    rng = random.Random(seed)
    cache = fed_by_hand()
    for i in range(NODES):
        sizes = [rng.choice((8, 16, 24)) for _ in range(rng.choice((1, 2, 4)))]
        cache.on_node(None, gpu_node(f"n{i:03}", inv=inventory(*sizes), cpu=str(rng.choice((8, 32)))))
        if rng.random() < 0.5:
            cache.on_pod(None, pod(f"run-{i}", rng.randint(1, 8), node=f"n{i:03}", phase="Running"))
    return cache


class Turns:
    """What each turn of the event loop priced: the nodes (their ledgers) priced between two yields."""

    def __init__(self, policy: Policy) -> None:
        self.turns: list[set[int]] = [set()]

        def priced(verdict: GpuVerdict, need: int, setting: PricingContext) -> float:
            self.turns[-1].add(id(setting.ledger))
            return policy.price(verdict, need, setting)

        self.policy = dataclasses.replace(policy, price=priced)

    async def yielded(self, _: float) -> None:
        self.turns.append(set())


def scheduler_of(cache: ClusterCache, policy: Policy) -> Scheduler:
    return Scheduler(cache=cache, api=None, policy=policy, resources=contract.DEFAULT_RESOURCES, rank_in_filter=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
@pytest.mark.parametrize("policy_name", ["fgd", "binpack"])
def test_a_verb_prices_a_turns_worth_per_turn_and_answers_as_in_one_go(
    verb: str, policy_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = Turns(policy_named(policy_name))
    monkeypatch.setattr(scheduler_module.asyncio, "sleep", turns.yielded)
    paced, in_one_go = scheduler_of(a_cluster(7), turns.policy), scheduler_of(a_cluster(7), turns.policy)
    names = sorted(paced.cache.state.node_names())
    args = ExtenderArgs(pod=pod("new", 3), node_names=names, nodes=None)

    answer: Any = asyncio.run(paced.paced(getattr(paced, verb), args))
    assert len(turns.turns) >= 4  # it did yield, between every turn's worth
    assert all(len(priced) <= PRICES_PER_TURN for priced in turns.turns)
    assert not turns.turns[-1]  # the turn that answered priced nothing: every rank was in the memos
    assert answer == getattr(in_one_go, verb)(args)


def test_a_node_that_changed_while_the_verb_yielded_is_priced_in_its_answering_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    turns = Turns(policy_named("fgd"))
    cache, twin = a_cluster(11), a_cluster(11)
    names = sorted(cache.state.node_names())
    bound = pod("bound", 2, node=names[0], phase="Running")

    async def yielded(seconds: float) -> None:
        await turns.yielded(seconds)
        if len(turns.turns) == 3:  # a watch event applied between two turns
            cache.on_pod(None, bound)

    monkeypatch.setattr(scheduler_module.asyncio, "sleep", yielded)
    paced = scheduler_of(cache, turns.policy)
    args = ExtenderArgs(pod=pod("new", 3), node_names=names, nodes=None)
    ranked = asyncio.run(paced.paced(paced.prioritize, args))
    assert turns.turns[-1] == {id(cache.state.nodes[names[0]].ledger)}  # the one node whose ledger changed
    twin.state.request_mix()  # taken before the pod came, as the paced cache's was
    twin.on_pod(None, bound)
    assert ranked == scheduler_of(twin, turns.policy).prioritize(args)


def test_a_warm_verb_answers_in_its_first_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to price (every rank in the memos), or nothing to rank (no GPU asked, a request that cannot
    be read): the verb answers at once, without yielding."""
    turns = Turns(policy_named("fgd"))
    monkeypatch.setattr(scheduler_module.asyncio, "sleep", turns.yielded)
    paced = scheduler_of(a_cluster(3), turns.policy)
    names = sorted(paced.cache.state.node_names())
    paced.prioritize(ExtenderArgs(pod=pod("warm", 3), node_names=names, nodes=None))
    bad = pod("bad", 3)
    bad["spec"]["containers"][0]["resources"]["limits"]["aliyun.com/gpu-mem"] = "lots"
    asked = [(body, verb) for body in (pod("warm", 3), bad) for verb in (paced.filter, paced.prioritize)]
    for body, verb in [*asked, (pod("cpu-only", 0), paced.filter)]:  # no node passes: nothing ranked
        turns.turns = [set()]
        asyncio.run(paced.paced(verb, ExtenderArgs(pod=body, node_names=names, nodes=None)))
        assert turns.turns == [set()], (body["metadata"]["name"], verb)
