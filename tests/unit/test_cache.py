"""The extender's cache under any order of watch events, binds it assumed and binds that failed: every pod
is counted on exactly the node the watch (or, until the watch shows it, this extender's bind) puts it on,
and nowhere else."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpushared import contract
from gpushared.core.fragmentation import RequestMix
from gpushared.core.ledger import Ledger
from gpushared.core.placement import GpuVerdict, Policy, bind_annotations, judge
from gpushared.core.requests import pod_request
from gpushared.extender import cache as cache_module
from gpushared.extender.cache import ASSUME_SECONDS, MIX_SECONDS, ClusterCache
from tests.builders import inventory, pod
from tests.extender_harness import gpu_node

NODES = ("n1", "n2", "n3")
UIDS = tuple(f"u{i}" for i in range(4))
INVENTORY = inventory(16, 16)


class CacheHistory(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = ClusterCache(
            list_nodes=lambda **_: None,
            list_pods=lambda **_: None,
            resources=contract.DEFAULT_RESOURCES,
            clock=lambda: self.now,
        )
        self.now = 0.0
        for name in NODES:
            self.cache.nodes.handler(None, gpu_node(name, inv=INVENTORY))  # type: ignore[misc]
        self.watched: dict[str, dict[str, Any]] = {}  # what the watch last said of each pod
        #: pods this extender bound and the watch has not shown bound yet: node and when the bind expires
        self.assumed: dict[str, tuple[str, float]] = {}

    def _body(self, uid: str, node: str | None) -> dict[str, Any]:
        body = pod(uid, 1 + UIDS.index(uid), uid=uid)  # sizes 1-4, so the mix tells them apart
        gpu = INVENTORY.gpus[UIDS.index(uid) % 2]  # both GPUs fill, so the most free one changes
        body["metadata"]["annotations"] = bind_annotations(pod_request(body), gpu, unit=INVENTORY.unit, now_ns=1)
        if node:
            body["spec"]["nodeName"] = node
        return body

    def _event(self, uid: str, new: dict[str, Any] | None) -> None:
        self.cache.pods.handler(self.watched.get(uid), new)  # type: ignore[misc]
        if new is None:
            self.watched.pop(uid, None)
        else:
            self.watched[uid] = new

    @rule(uid=st.sampled_from(UIDS))
    def created_pending(self, uid: str) -> None:
        self._event(uid, self._body(uid, None))

    @rule(uid=st.sampled_from(UIDS), node=st.sampled_from(NODES))
    def watch_shows_bound(self, uid: str, node: str) -> None:
        self._event(uid, self._body(uid, node))
        self.assumed.pop(uid, None)

    @rule(uid=st.sampled_from(UIDS))
    def deleted(self, uid: str) -> None:
        if uid in self.watched:
            self._event(uid, None)
            self.assumed.pop(uid, None)

    @rule(uid=st.sampled_from(UIDS), node=st.sampled_from(NODES))
    def bind_assumed(self, uid: str, node: str) -> None:
        if uid in self.watched and not self.watched[uid]["spec"].get("nodeName") and uid not in self.assumed:
            self.cache.assume(self._body(uid, None), node)
            self.assumed[uid] = (node, self.now + ASSUME_SECONDS)

    @rule(uid=st.sampled_from(UIDS))
    def bind_failed(self, uid: str) -> None:
        if uid in self.assumed:
            self.cache.forget(self._body(uid, None), self.assumed.pop(uid)[0])

    @invariant()
    def each_pod_counted_once_where_it_is_and_in_the_mix(self) -> None:
        # Time passes: binds the watch never confirmed are released after ASSUME_SECONDS, and the request
        # mix may be taken anew.
        self.now += MIX_SECONDS
        self.assumed = {uid: (node, end) for uid, (node, end) in self.assumed.items() if end >= self.now}
        holdings = []
        for name in NODES:
            snapshot = self.cache.snapshot(name)
            assert snapshot is not None
            holdings += [(name, h) for h in snapshot[1]]
        for uid in UIDS:
            bound = (self.watched.get(uid) or {}).get("spec", {}).get("nodeName")
            expected = {bound or self.assumed[uid][0]} if bound or uid in self.assumed else set()
            assert {name for name, h in holdings if h.uid == uid} == expected, uid
        mix = self.cache.request_mix()
        truth = RequestMix(sum(h.gpus.values()) + h.pending for _, h in holdings)
        assert len(mix) == len(truth) == len(holdings)
        assert [mix.larger_than(free) for free in range(18)] == [truth.larger_than(free) for free in range(18)]

    @invariant()
    def filter_agrees_with_judging_every_gpu(self) -> None:
        """Filter answers from a per-node number kept between changes; it must say what judging the node's
        current holdings GPU by GPU says, whatever came before."""
        names = [*NODES, "unknown"]
        for size in range(9, 18):  # most free is 10-16 GiB: some sizes fit, some do not, as pods come and go
            request = pod_request(pod("probe", size))
            passed, failed = self.cache.filter(names, request)
            fits = set()
            for name in NODES:
                snapshot = self.cache.snapshot(name)
                assert snapshot is not None
                if any(v.fits for v in judge(Ledger.build(INVENTORY, snapshot[1]), request)):
                    fits.add(name)
            assert set(passed) == fits, size
            assert set(failed) == set(names) - fits, size


CacheHistory.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestCacheHistory = CacheHistory.TestCase


def test_prices_that_do_not_read_the_mix_outlive_a_new_mix() -> None:
    """Each new mix (every MIX_SECONDS) would otherwise price every node again for every request size: the
    prioritize calls that pay for it are binpack's slowest, for nothing."""
    now = [0.0]
    cache = ClusterCache(
        list_nodes=lambda **_: None,
        list_pods=lambda **_: None,
        resources=contract.DEFAULT_RESOURCES,
        clock=lambda: now[0],
    )
    cache.nodes.handler(None, gpu_node("n1", inv=INVENTORY))  # type: ignore[misc]
    request = pod_request(pod("probe", 3))
    priced: list[int] = []

    def cost(verdict: GpuVerdict, need: int, mix: RequestMix) -> float:
        priced.append(verdict.free)
        return float(verdict.free - need)

    for reads_mix in (False, True):
        policy = Policy(name=f"counting-{reads_mix}", cost=cost, reads_mix=reads_mix)
        cache.node_costs(["n1"], request, policy)
        assert priced
        priced.clear()
        now[0] += MIX_SECONDS
        cache.node_costs(["n1"], request, policy)
        assert bool(priced) == reads_mix
        priced.clear()


def test_a_warm_cache_answers_filter_without_judging_any_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extender warms its cache before it says ready: right after a start, the first filters must not
    each judge hundreds of nodes for the first time."""
    cache = ClusterCache(list_nodes=lambda **_: None, list_pods=lambda **_: None, resources=contract.DEFAULT_RESOURCES)
    for name in NODES:
        cache.nodes.handler(None, gpu_node(name, inv=INVENTORY))  # type: ignore[misc]
    cache.warm()
    judged: list[object] = []
    monkeypatch.setattr(cache_module, "most_free", lambda *a, **k: judged.append(a) or 0)
    passed, failed = cache.filter(list(NODES), pod_request(pod("probe", 4)))
    assert sorted(passed) == sorted(NODES) and not failed
    assert not judged
