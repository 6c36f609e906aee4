"""The extender's cache under any order of watch events, binds it assumed and binds that failed: every pod
is counted on exactly the node the watch (or, until the watch shows it, this extender's bind) puts it on,
and nowhere else."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpushared import contract
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.policies import BINPACK
from gpushared.core.placement.pricing import NodeCpu
from gpushared.core.placement.reservations import LANDING_SECONDS, ghost_uid
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.requests import pod_request
from gpushared.core.shared.verdicts import judge, no_room
from gpushared.extender import index as index_module
from gpushared.extender.cache import Rejected
from gpushared.extender.index import STALE, Rooms
from gpushared.extender.state import MIX_SECONDS
from tests.builders import inventory, on_gpus, pod
from tests.extender_harness import fed_by_hand, gpu_node

NODES = ("n1", "n2", "n3")
UIDS = tuple(f"u{i}" for i in range(5))  # u0-u3 ask for 1-4 GiB, u4 for no GPU
INVENTORY = inventory(16, 16)


def cpu_milli(uid: str) -> int:
    return 500 * (1 + UIDS.index(uid))


class CacheHistory(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = fed_by_hand(clock=lambda: self.now)
        self.now = 0.0
        for name in NODES:
            self.cache.on_node(None, gpu_node(name, inv=INVENTORY, cpu="8"))
        self.watched: dict[str, dict[str, Any]] = {}  # what the watch last said of each pod
        #: pods this extender bound and the watch has not shown bound yet: their node
        self.assumed: dict[str, str] = {}
        #: Bindings whose answer was lost: (pod uid, node) -> when they were sent
        self.unanswered: dict[tuple[str, str], float] = {}
        self.sent: dict[str, float] = {}

    def _body(self, uid: str, node: str | None, phase: str = "Pending") -> dict[str, Any]:
        cpu = f"{cpu_milli(uid)}m"
        if uid == UIDS[-1]:
            body = pod(uid, uid=uid, cpu=cpu, phase=phase)
        else:
            body = pod(uid, 1 + UIDS.index(uid), uid=uid, cpu=cpu, phase=phase)  # sizes 1-4: the mix tells them apart
            gpus = [INVENTORY.gpus[UIDS.index(uid) % 2]]  # both GPUs fill, so the most free one changes
            if uid == UIDS[-2]:  # 2 GiB on each GPU (gpu-count 2)
                gpus = list(INVENTORY.gpus)
                on_gpus(body, 2)
            body["metadata"]["annotations"] = bind_annotations(pod_request(body), gpus, unit=INVENTORY.unit, now_ns=1)
        if node:
            body["spec"]["nodeName"] = node
        return body

    def _counted(self, uid: str) -> str | None:
        """The node the pod should be counted on: where the watch or this extender's bind puts it, unless
        it has finished."""
        watched = self.watched.get(uid) or {}
        if watched.get("status", {}).get("phase") == "Succeeded":
            return None
        bound = watched.get("spec", {}).get("nodeName")
        return bound or self.assumed.get(uid)

    def _event(self, uid: str, new: dict[str, Any] | None) -> None:
        self.cache.on_pod(self.watched.get(uid), new)
        if new is None:
            self.watched.pop(uid, None)
        else:
            self.watched[uid] = new
        if new is None or new["spec"].get("nodeName"):
            # seen bound or deleted: no Binding of it can land any more
            self.unanswered = {k: v for k, v in self.unanswered.items() if k[0] != uid}

    @rule(uid=st.sampled_from(UIDS))
    def created_pending(self, uid: str) -> None:
        self._event(uid, self._body(uid, None))

    @rule(uid=st.sampled_from(UIDS), node=st.sampled_from(NODES))
    def watch_shows_bound(self, uid: str, node: str) -> None:
        if uid in self.watched and self.watched[uid]["spec"].get("nodeName"):
            return  # a bound pod stays where it is
        if uid in self.assumed:
            node = self.assumed[uid]  # the Binding that was created is the one that landed
        self._event(uid, self._body(uid, node))
        self.assumed.pop(uid, None)

    @rule(node=st.sampled_from(NODES))
    def node_unreadable_for_a_while(self, node: str) -> None:
        """Its ledger goes and comes back (rebuilt from the pods bound to it): nothing counted twice or lost."""
        good = gpu_node(node, inv=INVENTORY, cpu="8")
        broken = copy.deepcopy(good)
        broken["metadata"]["annotations"][contract.NODE_INVENTORY] = "{not json"
        self.cache.on_node(good, broken)
        assert isinstance(self.cache.index.judge(node, pod("probe"), pod_request(pod("probe", 1))), Rejected)
        self.cache.on_node(broken, good)

    @rule(uid=st.sampled_from(UIDS))
    def finished(self, uid: str) -> None:
        bound = (self.watched.get(uid) or {}).get("spec", {}).get("nodeName")
        if bound:
            self._event(uid, self._body(uid, bound, phase="Succeeded"))

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
            self.sent[uid] = self.now  # when the Binding was sent: its landing window starts there

    @rule(uid=st.sampled_from(UIDS))
    def bind_failed(self, uid: str) -> None:
        if uid in self.assumed:
            self.cache.forget(self._body(uid, None), self.assumed.pop(uid))

    @rule(uid=st.sampled_from(UIDS))
    def bind_unanswered(self, uid: str) -> None:
        """The Binding's answer is lost: its memory stays on the node, and the pod may be bound again."""
        if uid in self.assumed:
            node = self.assumed.pop(uid)
            self.cache.unanswered(self._body(uid, None), node)
            self.unanswered[(uid, node)] = self.sent[uid]

    @rule(data=st.data())
    def read_back(self, data: st.DataObject) -> None:
        """The settler reads a reservation's pod back; what the API server says is what the watch says
        (or, for a pod the watch never had, that it is gone)."""
        due = self.cache.due(limit=100)
        if not due:
            return
        assumed = data.draw(st.sampled_from(due))
        read = self.watched.get(assumed.uid)
        if read is not None and assumed.uid in self.assumed:
            read = self._body(assumed.uid, self.assumed[assumed.uid])  # created, not yet watched
        outcome = self.cache.settle(assumed, read)
        if outcome is None:
            return
        if read is None or read["spec"].get("nodeName"):
            self.unanswered = {k: v for k, v in self.unanswered.items() if k[0] != assumed.uid}
            if read is not None:
                self.watched[assumed.uid] = read  # counted from the read: as if the watch had shown it
                self.cache.on_pod(None, read)
                self.assumed.pop(assumed.uid, None)
        elif (
            assumed.unanswered
            and self.now - self.unanswered.get((assumed.uid, assumed.node), self.now) >= LANDING_SECONDS
        ):
            del self.unanswered[(assumed.uid, assumed.node)]

    @invariant()
    def each_pod_counted_once_where_it_is_and_in_the_mix(self) -> None:
        # Time passes: nothing the watch never confirmed is released for that alone (only evidence ends a
        # reservation), and the request mix may be taken anew.
        self.now += MIX_SECONDS
        holdings = []
        for name in NODES:
            snapshot = self.cache.state.snapshot(name)
            assert snapshot is not None
            holdings += [(name, h) for h in snapshot[1]]
        for uid in UIDS[:-1]:
            expected = {self._counted(uid)} - {None}
            assert {name for name, h in holdings if h.uid == uid} == expected, uid
            # an unanswered Binding's memory stays on its node, beside wherever the pod is counted
            for node in NODES:
                ghost = [h for name, h in holdings if name == node and h.uid == ghost_uid(uid, node)]
                assert len(ghost) == ((uid, node) in self.unanswered), (uid, node)
        shapes = {uid: (1 + UIDS.index(uid), 1) for uid in UIDS[:-2]} | {UIDS[-2]: (2, 2), UIDS[-1]: (0, 0)}
        kinds = [(cpu_milli(uid), *shapes[uid]) for uid in UIDS if self._counted(uid)]
        kinds += [(cpu_milli(uid), *shapes[uid]) for uid, _ in self.unanswered]  # it may land: it counts
        mix, truth = self.cache.state.request_mix(), RequestMix(kinds)
        assert len(mix) == len(truth) == len(kinds)
        for frees in ([1, 2, 3], [4, 0], [16, 16], [2, 2, 1]):
            for cpu_free in (None, 0, 500, 1200, 2500, 9000):
                assert mix.fragment(frees, cpu_free=cpu_free) == truth.fragment(frees, cpu_free=cpu_free)
        for name in NODES:
            judged = self.cache.index.judge(name, pod("probe"), pod_request(pod("probe", 1)))
            assert not isinstance(judged, Rejected) and judged[1].cpu is not None
            requested = sum(cpu_milli(uid) for uid in UIDS if self._counted(uid) == name)
            requested += sum(cpu_milli(uid) for uid, node in self.unanswered if node == name)
            assert judged[1].cpu == NodeCpu(allocatable=8000, requested=requested), name

    @invariant()
    def filter_agrees_with_judging_every_gpu(self) -> None:
        """Filter answers from a per-node number kept between changes; it must say what judging the node's
        current holdings GPU by GPU says, whatever came before."""
        names = [*NODES, "unknown"]
        # Most free is 10-16 GiB: some sizes fit, some do not, as pods come and go; on one GPU or on both.
        for size, gpus in [(size, 1) for size in range(9, 18)] + [(2 * share, 2) for share in range(9, 17)]:
            request = pod_request(on_gpus(pod("probe", size), gpus))
            passed, failed = self.cache.index.filter(names, request)
            fits = set()
            for name in NODES:
                snapshot = self.cache.state.snapshot(name)
                assert snapshot is not None
                if sum(v.fits for v in judge(Ledger.build(INVENTORY, snapshot[1]), request)) >= gpus:
                    fits.add(name)
            assert set(passed) == fits, (size, gpus)
            assert set(failed) == set(names) - fits, (size, gpus)
            # Every GPU here is usable, so a node that does not fit is one whose GPUs are too full.
            assert {failed[name] for name in NODES if name not in fits} <= {no_room(request, unit=INVENTORY.unit)}


CacheHistory.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestCacheHistory = CacheHistory.TestCase


def test_a_warm_cache_answers_filter_without_judging_any_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extender warms its cache before it says ready: right after a start, the first filters must not
    each judge hundreds of nodes for the first time."""
    cache = fed_by_hand()
    for name in NODES:
        cache.on_node(None, gpu_node(name, inv=INVENTORY))
    cache.index.warm()
    judged: list[object] = []
    monkeypatch.setattr(index_module, "most_free", lambda *a, **k: judged.append(a) or 0)
    passed, failed = cache.index.filter(list(NODES), pod_request(pod("probe", 4)))
    assert sorted(passed) == sorted(NODES) and not failed
    assert not judged


def test_the_room_table_keeps_every_room_across_compactions_and_stale_marks() -> None:
    """Filter reads rooms from two dicts whose keys are copied side by side; what they answer must not
    depend on when the table was compacted or how nodes were marked stale."""
    rooms = Rooms()
    names = [f"node-{i}" for i in range(300)]  # enough to compact several times while growing
    for i, name in enumerate(names):
        rooms.put(name, plain=i % 17, mps=i % 5, unit="GiB" if i % 3 else "MiB")
    rooms.stale("node-7")
    rooms.stale("no-such-node")  # a name never put stays out of the table
    rooms.put("node-8", plain=99, mps=98, unit="GiB")  # a changed room, written in place
    rooms.compact()
    assert len(rooms) == len(names) and "no-such-node" not in rooms
    plain, mps = rooms.of(mps=False), rooms.of(mps=True)
    assert list(plain) == names and list(mps) == names and list(rooms.units) == names
    assert all(a is b is c for a, b, c in zip(plain, mps, rooms.units, strict=True))  # one copy of each key
    assert not any(key is name for key, name in zip(plain, names, strict=True))  # copies, not the originals
    expected = {name: (i % 17, i % 5) for i, name in enumerate(names)} | {"node-7": (STALE, STALE), "node-8": (99, 98)}
    assert {name: (plain[name], mps[name]) for name in names} == expected
    assert rooms.units["node-8"] == "GiB" and rooms.units["node-9"] == "MiB"


def test_the_watch_confirming_a_bind_leaves_the_nodes_room_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch shows every pod pending before it shows it bound. Counting the bind again on that event
    would make every filter after every bind work the node's room out anew, for nothing."""
    cache = fed_by_hand()
    cache.on_node(None, gpu_node("n1", inv=INVENTORY))
    pending = pod("p", 3, uid="u1")
    cache.on_pod(None, pending)
    reserved = cache.reserve("n1", pending, pod_request(pending), policy=BINPACK, now_ns=1)  # type: ignore[arg-type]
    assert not isinstance(reserved, Rejected)
    cache.index.warm()
    bound = copy.deepcopy(pending)
    bound["metadata"]["annotations"] = reserved.annotations
    bound["spec"]["nodeName"] = "n1"
    worked_out: list[object] = []
    monkeypatch.setattr(index_module, "most_free", lambda *a, **k: worked_out.append(a) or 0)
    cache.on_pod(pending, bound)
    assert cache.index.filter(["n1"], pod_request(pod("q", 13)))[0] == ["n1"]  # 16 - 3 free, as before the event
    assert not worked_out


def test_a_pod_recreated_under_its_name_while_the_watch_was_down_is_counted_once() -> None:
    """A relist hands over (old, new) for a name whose pod was deleted and created again: the old pod's
    memory is free, wherever the new one runs."""
    cache = fed_by_hand()
    for name in ("n1", "n2"):
        cache.on_node(None, gpu_node(name, inv=INVENTORY))
    before = pod("p", 5, uid="u1", node="n1")
    before["metadata"]["annotations"] = bind_annotations(
        pod_request(before), INVENTORY.gpus[:1], unit=INVENTORY.unit, now_ns=1
    )
    after = pod("p", 4, uid="u2", node="n2")
    after["metadata"]["annotations"] = bind_annotations(
        pod_request(after), INVENTORY.gpus[:1], unit=INVENTORY.unit, now_ns=2
    )
    cache.on_pod(None, before)
    cache.on_pod(before, after)
    holders = {}
    for name in ("n1", "n2"):
        snapshot = cache.state.snapshot(name)
        assert snapshot is not None
        holders[name] = [h.uid for h in snapshot[1]]
    assert holders == {"n1": [], "n2": ["u2"]}


@pytest.mark.parametrize("edit", ["other-gpu", "no-choice", "zero"])
def test_a_bound_pods_gpu_choice_edited_by_its_owner_does_not_move_the_books(edit: str) -> None:
    """Defect: patching a running pod's allocation (or Aliyun's keys) freed its memory in the extender's books,
    and other pods were bound onto the GPU it still used."""
    cache = fed_by_hand()
    cache.on_node(None, gpu_node("n1", inv=INVENTORY))
    bound = pod("p", 12, uid="u1", node="n1", phase="Running")
    bound["metadata"]["annotations"] = bind_annotations(
        pod_request(bound), INVENTORY.gpus[:1], unit=INVENTORY.unit, now_ns=1
    )
    cache.on_pod(None, bound)
    edited = copy.deepcopy(bound)
    annotations = edited["metadata"]["annotations"]
    if edit == "other-gpu":
        annotations.update(bind_annotations(pod_request(bound), INVENTORY.gpus[1:], unit=INVENTORY.unit, now_ns=1))
    elif edit == "no-choice":
        annotations.clear()
    else:
        annotations[contract.POD_ALLOCATION] = annotations[contract.POD_ALLOCATION].replace('"amount":12', '"amount":0')
    cache.on_pod(bound, edited)
    snapshot = cache.state.snapshot("n1")
    assert snapshot is not None
    assert [(h.uid, h.gpus) for h in snapshot[1]] == [("u1", {0: 12})]
    assert cache.index.filter(["n1"], pod_request(pod("q", 5)))[0] == ["n1"]  # 4 left on GPU 0, 16 on GPU 1
    assert cache.index.filter(["n1"], pod_request(pod("q", 17)))[0] == []
    assert cache.state.allocation_edits == (edit != "zero")


def with_compute(body: dict[str, Any], request: int) -> dict[str, Any]:
    body["metadata"]["annotations"][contract.POD_COMPUTE_REQUEST] = str(request)
    return body


def test_compute_requests_are_filtered_ranked_and_reserved_on_both_dimensions() -> None:
    """Three pods with compute requests fill GPU 0's compute (binpack keeps them there: memory is
    plentiful); a fourth goes to GPU 1, and a node whose GPUs have too little compute is refused with why.
    A pod without compute still fits where compute is all taken: it asks for memory alone."""
    cache = fed_by_hand()
    cache.on_node(None, gpu_node("n1", inv=INVENTORY))
    placed = []
    for i, share in enumerate((30, 30, 40)):
        body = with_compute(pod(f"p{i}", 2, uid=f"c{i}"), share)
        cache.on_pod(None, body)
        reserved = cache.reserve("n1", body, pod_request(body), policy=BINPACK, now_ns=1)  # type: ignore[arg-type]
        assert not isinstance(reserved, Rejected)
        placed.append(contract.parse_allocation(reserved.annotations[contract.POD_ALLOCATION]))
    assert {share.index for a in placed for c in a.containers for share in c.gpus} == {0}
    fourth = with_compute(pod("p3", 2, uid="c3"), 10)
    assert cache.index.filter(["n1"], pod_request(fourth))[0] == ["n1"]  # GPU 1 has all its compute
    cache.on_pod(None, fourth)
    reserved = cache.reserve("n1", fourth, pod_request(fourth), policy=BINPACK, now_ns=2)  # type: ignore[arg-type]
    assert not isinstance(reserved, Rejected)
    (container,) = contract.parse_allocation(reserved.annotations[contract.POD_ALLOCATION]).containers
    assert [share.index for share in container.gpus] == [1]
    greedy = with_compute(pod("greedy", 1, uid="g"), 95)
    passed, failed = cache.index.filter(["n1"], pod_request(greedy))
    assert passed == [] and failed["n1"] == (
        "GPU 0 has 0 percent of its compute unrequested, pod requests 95 percent; "
        "GPU 1 has 90 percent of its compute unrequested, pod requests 95 percent"
    )
    ranks = cache.index.node_ranks(["n1"], greedy, pod_request(greedy), BINPACK)  # type: ignore[arg-type]
    assert ranks == [None]
    plain = pod("plain", 1, uid="q")
    assert cache.index.filter(["n1"], pod_request(plain))[0] == ["n1"]
    assert cache.index.node_ranks(["n1"], plain, pod_request(plain), BINPACK)[0] is not None  # type: ignore[arg-type]


def test_a_node_filtered_first_for_a_pod_on_several_gpus_is_refused_with_the_reason() -> None:
    """Regression (found by the e2e suite run out of its usual order): a node whose room table had no
    entry yet, because only pods on several GPUs or with compute requests were filtered since it came,
    failed filter with a 500 ("'' is not a valid MemoryUnit") instead of the too-full reason."""
    cache = fed_by_hand()
    cache.on_node(None, gpu_node("n1", inv=INVENTORY))
    wide = pod_request(on_gpus(pod("wide", 40), 2))  # 20 GiB on each of two 16 GiB GPUs
    passed, failed = cache.index.filter(["n1"], wide)
    assert passed == [] and failed == {"n1": no_room(wide, unit=INVENTORY.unit)}
