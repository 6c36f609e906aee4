"""The extender's cache under any order of watch events, binds it assumed and binds that failed: every pod
is counted on exactly the node the watch (or, until the watch shows it, this extender's bind) puts it on,
and nowhere else."""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpushared import contract
from gpushared.core.placement import bind_annotations
from gpushared.core.requests import pod_request
from gpushared.extender.cache import ClusterCache
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
            clock=lambda: 0.0,  # assumed binds never expire here
        )
        for name in NODES:
            self.cache.nodes.handler(None, gpu_node(name, inv=INVENTORY))  # type: ignore[misc]
        self.watched: dict[str, dict[str, Any]] = {}  # what the watch last said of each pod
        self.assumed: dict[str, str] = {}  # pods this extender bound and the watch has not shown bound yet

    def _body(self, uid: str, node: str | None) -> dict[str, Any]:
        body = pod(uid, 2, uid=uid)
        body["metadata"]["annotations"] = bind_annotations(
            pod_request(body), INVENTORY.gpus[0], unit=INVENTORY.unit, now_ns=1
        )
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
            self.assumed[uid] = node

    @rule(uid=st.sampled_from(UIDS))
    def bind_failed(self, uid: str) -> None:
        if uid in self.assumed:
            self.cache.forget(self._body(uid, None), self.assumed.pop(uid))

    @invariant()
    def each_pod_counted_once_where_it_is(self) -> None:
        for uid in UIDS:
            bound = (self.watched.get(uid) or {}).get("spec", {}).get("nodeName")
            expected = {bound or self.assumed[uid]} if bound or uid in self.assumed else set()
            counted = set()
            for name in NODES:
                snapshot = self.cache.snapshot(name)
                assert snapshot is not None
                if any(h.uid == uid for h in snapshot[1]):
                    counted.add(name)
            assert counted == expected, (uid, counted, expected)

    @invariant()
    def ledgers_match_what_is_counted(self) -> None:
        for name in NODES:
            snapshot = self.cache.snapshot(name)
            assert snapshot is not None
            held = sum(sum(h.gpus.values()) for h in snapshot[1])
            assert held == 2 * len(snapshot[1])


CacheHistory.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestCacheHistory = CacheHistory.TestCase
