"""Tenants write annotations too: whatever text lands in a key the contract reads, no book raises and no other
pod's holding moves (issue #39, defect 1).

Before the contract bounded what it parses, a 5,000-digit ``ALIYUN_COM_GPU_MEM_IDX`` raised CPython's
ValueError ("Exceeds the limit (4300 digits)") out of ``holding_from_pod``: the node daemon exited on every
start, and the extender's ledger rebuild stopped at that pod and forgot the pods after it."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushared import contract
from gpushared.contract import ContractError, MemoryUnit
from gpushared.core.node.handshake import Candidate
from gpushared.core.shared.ledger import Ledger, holding_from_pod, inventory_from_node
from gpushared.core.shared.requests import pod_request, spec_request
from gpushared.daemon.accounting import EVENT_UNREADABLE, Accounting
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.extender.state import ClusterState
from tests.builders import CHOICE_KEYS, OPT_IN_KEYS, inventory, pod
from tests.extender_harness import gpu_node

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

#: Every pod annotation key the contract reads.
POD_KEYS = (*CHOICE_KEYS, *OPT_IN_KEYS)

INVENTORY = inventory(16, 16)
UUIDS = [gpu.uuid for gpu in INVENTORY.gpus]

#: Decimal digits past int64 and past CPython's 4,300-digit limit on int(), with or without a sign.
huge = st.builds(
    lambda sign, digits: sign + digits,
    st.sampled_from(["", "-"]),
    st.text(alphabet="0123456789", min_size=19, max_size=6000),
)
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.floats(allow_nan=True),
        st.text(max_size=20),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
#: Stands for a huge number in a JSON body; put in as text, as a tenant would (json.dumps cannot write one).
HUGE = "HUGE-NUMBER"


@st.composite
def allocation_like(draw: st.DrawFn) -> str:
    """An allocation annotation whose fields (one or several) are replaced by hostile values."""
    share: dict[str, Any] = {"index": 0, "uuid": UUIDS[0], "amount": 4}
    body: dict[str, Any] = {"version": 1, "unit": "GiB", "containers": [{"name": "c0", "gpus": [share]}]}
    for field in draw(st.sets(st.sampled_from(["index", "uuid", "amount", "version", "unit", "gpus", "name"]))):
        value = draw(st.one_of(json_values, st.just(HUGE)))
        if field in share:
            share[field] = value
        elif field in ("gpus", "name"):
            body["containers"][0][field] = value
        else:
            body[field] = value
    return json.dumps(body).replace(f'"{HUGE}"', draw(huge))


hostile_text = st.one_of(
    huge,
    st.integers().map(str),
    st.floats().map(str),
    st.text(max_size=40),
    st.text(alphabet="0123456789٠١٢³²-+ .e", max_size=30),
    json_values.map(json.dumps),
    allocation_like(),
    st.integers(min_value=1, max_value=100_000).map(lambda depth: "[" * depth + "]" * depth),
    st.integers(min_value=1, max_value=5000).map(lambda depth: '{"a":' * depth + "1" + "}" * depth),
    st.just("1" * 300_000),
)

#: The neighbours: three well-formed pods on the node, one per way a GPU choice is written.
NEIGHBOURS = [
    pod("a", 4, node="n1", annotations={contract.ALIYUN_GPU_MEM_IDX: "0", contract.ALIYUN_GPU_MEM_POD: "4"}),
    pod(
        "b",
        2,
        node="n1",
        annotations={
            contract.POD_ALLOCATION: contract.format_allocation(
                contract.Allocation(
                    unit=MemoryUnit.GIB,
                    containers=(contract.ContainerShares(name="c0", gpus=(contract.GpuShare(1, UUIDS[1], 2),)),),
                )
            )
        },
    ),
    pod("c", 3, node="n1", annotations={contract.ALIYUN_FRAMEWORK_ALLOCATION: '{"0": {"1": 3}}'}),
]


def hostile_pod(key: str, text: str, amount: int) -> dict[str, Any]:
    return pod("hostile", *([amount] if amount else []), node="n1", annotations={key: text})


def expected_neighbours() -> dict[str, Any]:
    return {
        n["metadata"]["uid"]: holding_from_pod(n, unit=MemoryUnit.GIB)
        for n in NEIGHBOURS  # each read on its own: nothing else on the node can change it
    }


def counts_at_least_its_spec(ledger: Ledger, body: dict[str, Any]) -> None:
    holding = ledger.holding(body["metadata"]["uid"])
    asked = spec_request(body).total
    if asked:
        assert holding is not None
        assert sum(holding.gpus.values()) + holding.pending >= asked


settings_ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings_
@given(key=st.sampled_from(POD_KEYS), text=hostile_text, amount=st.sampled_from([0, 3]))
def test_the_core_reads_any_annotation_into_a_holding_or_a_contract_error(key: str, text: str, amount: int) -> None:
    body = hostile_pod(key, text, amount)
    holding = holding_from_pod(body, unit=MemoryUnit.GIB)
    if amount:
        assert holding is not None
        assert sum(holding.gpus.values()) + holding.pending >= amount
    try:
        pod_request(body)
    except ContractError as exc:
        message = str(exc)
        assert len(message) < 1000  # the message names the value, cut short
    assert Candidate(pod=body, slots=None, next=None).assume_time >= 0


@settings_
@given(key=st.sampled_from(POD_KEYS), text=hostile_text, amount=st.sampled_from([0, 3]), first=st.booleans())
def test_the_extenders_books_count_every_other_pod_whatever_one_pod_says(
    key: str, text: str, amount: int, first: bool
) -> None:
    state = ClusterState(resources=contract.DEFAULT_RESOURCES)
    state.on_node(None, gpu_node("n1", inv=INVENTORY, cpu="8"))
    body = hostile_pod(key, text, amount)
    pods = [body, *NEIGHBOURS] if first else [*NEIGHBOURS, body]
    for each in pods:
        state.on_pod(None, each, assumed=lambda uid: False)
    # A rebuild (the node's GPUs changed) reads every pod again, the hostile one among them.
    state.on_node(None, gpu_node("n1", inv=inventory(16, 16, 8), cpu="8"))
    ledger = state.nodes["n1"].ledger
    assert ledger is not None
    for uid, holding in expected_neighbours().items():
        assert ledger.holding(uid) == holding
    counts_at_least_its_spec(ledger, body)
    assert state.request_mix() is not None


class _Pods:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self._pods = pods
        self.changes = 1

    def pods(self) -> list[dict[str, Any]]:
        return self._pods


class _Outbox:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def event(self, pod: dict[str, Any], reason: str, message: str, *, warning: bool) -> None:
        self.events.append((pod["metadata"]["name"], reason, message))


def _accounting(pods: list[dict[str, Any]]) -> tuple[Accounting, _Outbox]:
    outbox = _Outbox()
    books = Accounting(
        unit=MemoryUnit.GIB,
        resources=contract.DEFAULT_RESOURCES,
        pods=_Pods(pods),  # type: ignore[arg-type]
        metrics=DaemonMetrics(),
        outbox=outbox,  # type: ignore[arg-type]
    )
    return books, outbox


@settings_
@given(key=st.sampled_from(POD_KEYS), text=hostile_text, amount=st.sampled_from([0, 3]))
def test_the_daemons_books_count_every_other_pod_whatever_one_pod_says(key: str, text: str, amount: int) -> None:
    body = hostile_pod(key, text, amount)
    books, outbox = _accounting([body, *NEIGHBOURS])
    ledger = books.ledger(INVENTORY)
    for uid, holding in expected_neighbours().items():
        assert ledger.holding(uid) == holding
    counts_at_least_its_spec(ledger, body)
    books.shares(INVENTORY)
    for _, _, message in outbox.events:
        assert len(message) <= 1000


@pytest.mark.parametrize(
    ("key", "text"),
    [
        (contract.ALIYUN_GPU_MEM_IDX, "1" * 5000),
        (
            contract.POD_ALLOCATION,
            '{"version":1,"unit":"GiB","containers":[{"name":"c0","gpus":[{"index":'
            + "1" * 5000
            + ',"uuid":"x","amount":1}]}]}',
        ),
        (contract.POD_MPS_THREAD_PERCENTAGE, "9" * 9000),
        (contract.ALIYUN_GPU_MEM_ASSUME_TIME, "7" * 5000),
    ],
    ids=["idx-5000-digits", "allocation-5000-digit-index", "thread-percentage-9000-digits", "assume-time"],
)
def test_the_reported_poisons_are_counted_with_an_event(key: str, text: str) -> None:
    """The values of the report, one by one: the pod is counted at its spec (4 GiB pending), its owner gets
    one Event however often the daemon reads it, and the metric counts it once."""
    body = pod("poisoned", 4, node="n1", annotations={key: text})
    books, outbox = _accounting([body, *NEIGHBOURS])
    for _ in range(3):
        books._holdings.clear()  # read again, as after a new resourceVersion with the same text
        ledger = books.ledger(INVENTORY)
    holding = ledger.holding(body["metadata"]["uid"])
    assert holding is not None
    if key == contract.ALIYUN_GPU_MEM_ASSUME_TIME:  # read only to order pods at Allocate: nothing unreadable
        assert holding.pending == 4 and holding.problem is None and not outbox.events
        return
    assert holding.problem is not None
    assert sum(holding.gpus.values()) + holding.pending == 4
    assert [(name, reason) for name, reason, _ in outbox.events] == [("poisoned", EVENT_UNREADABLE)]
    assert "4 GiB" in outbox.events[0][2]
    assert books.metrics.unreadable_pods._value.get() == 1


@settings_
@given(text=hostile_text)
def test_a_hostile_inventory_is_a_node_problem(text: str) -> None:
    node = gpu_node("n1", inv=INVENTORY, cpu="8")
    node["metadata"]["annotations"][contract.NODE_INVENTORY] = text
    with contextlib.suppress(ContractError):
        inventory_from_node(node)
    state = ClusterState(resources=contract.DEFAULT_RESOURCES)
    state.on_node(None, node)
    for each in NEIGHBOURS:
        state.on_pod(None, each, assumed=lambda uid: False)
    found = state.nodes["n1"]
    assert found.problem is not None or found.inventory is not None


def test_the_extender_counts_unreadable_pods() -> None:
    state = ClusterState(resources=contract.DEFAULT_RESOURCES)
    state.on_node(None, gpu_node("n1", inv=INVENTORY, cpu="8"))
    body = pod("poisoned", 4, node="n1", annotations={contract.ALIYUN_GPU_MEM_IDX: "1" * 5000})
    state.on_pod(None, body, assumed=lambda uid: False)
    assert state.unreadable == {body["metadata"]["uid"]}
    state.on_pod(body, None, assumed=lambda uid: False)
    assert state.unreadable == set()
