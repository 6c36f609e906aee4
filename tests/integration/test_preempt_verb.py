"""The extender's preempt verb over HTTP: kube-scheduler's node-level victims revised to pods that free a GPU,
and the GPU they free held for the preemptor until it binds."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from tests.builders import inventory, pod
from tests.extender_harness import Extender, gpu_node
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.store import RESOURCES
from tests.harness import protect, wait_until

#: The node of the scenario: four GPUs of 16, 12, 24 and 8 GiB.
SIZES = (16, 12, 24, 8)
INV = inventory(*SIZES)
LOW, HIGH = 0, 100_000


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.create(gpu_node("g4", inv=INV))
        yield server


def placed(name: str, gib: int, gpu: int, *, priority: int = LOW) -> dict[str, Any]:
    """A pod bound to g4 with its GPU recorded, as a bind by the extender leaves it."""
    body = pod(name, gib, node="g4", phase="Running")
    body["spec"]["priority"] = priority
    annotations = bind_annotations(pod_request(body), [INV.gpus[gpu]], unit=INV.unit, now_ns=time.time_ns())
    body["metadata"]["annotations"] = annotations
    return body


def waiting(name: str, gib: int, *, priority: int) -> dict[str, Any]:
    body = pod(name, gib)
    body["spec"]["priority"] = priority
    return body


def used(extender: Extender) -> int:
    nodes = extender.inspect("g4")[1].get("nodes") or [{"devs": []}]  # none before the node is watched
    return sum(dev["usedGPU"] for dev in nodes[0]["devs"])


def nine_low_pods(api: FakeApiServer, extender: Extender) -> dict[str, dict[str, Any]]:
    """54 of 60 GiB: GPU 0 12/16, GPU 1 12/12, GPU 2 24/24, GPU 3 6/8; no GPU with 10 GiB free."""
    layout = [0, 0, 1, 1, 2, 2, 2, 2, 3]
    low = {f"low-{i}": api.create(placed(f"low-{i}", 6, gpu)) for i, gpu in enumerate(layout)}
    wait_until(lambda: used(extender) == 54, message="the nine pods watched")
    return low


def preempt(extender: Extender, preemptor: dict[str, Any], victims: dict[str, list[str]]) -> dict[str, Any]:
    status, body = extender.post(
        "preempt",
        {
            "Pod": preemptor,
            "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {
                node: {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": 0} for node, uids in victims.items()
            },
        },
    )
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def nominate(api: FakeApiServer, body: dict[str, Any], node: str) -> None:
    current = api.get("pods", body["metadata"]["name"], "default")
    assert current is not None
    current.setdefault("status", {})["nominatedNodeName"] = node
    name = current["metadata"]["name"]
    api.store.update(RESOURCES["pods"], "default", name, current, subresource="status", precondition_rv=None)


def test_the_victims_free_one_gpu_not_node_memory(api: FakeApiServer, extender: Extender) -> None:
    """kube-scheduler picked a pod on the full 24 GiB GPU (GPU 2 to 18/24: still no 10 GiB anywhere); the
    extender answers one pod on GPU 0, which then has 10 GiB free."""
    low = nine_low_pods(api, extender)
    high = api.create(waiting("high", 10, priority=HIGH))
    answer = preempt(extender, high, {"g4": [low["low-4"]["metadata"]["uid"]]})
    victims = answer["NodeNameToMetaVictims"]["g4"]["Pods"]
    assert [v["UID"] for v in victims] in ([low["low-0"]["metadata"]["uid"]], [low["low-1"]["metadata"]["uid"]])


def test_equal_priority_is_never_evicted_and_the_node_is_dropped(api: FakeApiServer, extender: Extender) -> None:
    nine_low_pods(api, extender)
    peer = api.create(waiting("peer", 10, priority=LOW))
    assert preempt(extender, peer, {"g4": []}) == {"NodeNameToMetaVictims": {}}


def test_preemption_policy_never_evicts_nothing(api: FakeApiServer, extender: Extender) -> None:
    low = nine_low_pods(api, extender)
    body = waiting("polite", 10, priority=HIGH)
    body["spec"]["preemptionPolicy"] = "Never"
    polite = api.create(body)
    assert preempt(extender, polite, {"g4": [low["low-4"]["metadata"]["uid"]]}) == {"NodeNameToMetaVictims": {}}


def test_the_freed_gpu_is_held_for_the_preemptor(api: FakeApiServer, extender: Extender) -> None:
    """Once the victim is gone, a lower-priority pod that would fit only there is kept off the node while the
    preemptor waits nominated; the preemptor passes and is bound to the GPU its victim freed."""
    low = nine_low_pods(api, extender)
    high = api.create(waiting("high", 10, priority=HIGH))
    answer = preempt(extender, high, {"g4": [low["low-4"]["metadata"]["uid"]]})
    (victim,) = [v["UID"] for v in answer["NodeNameToMetaVictims"]["g4"]["Pods"]]
    name = next(n for n, body in low.items() if body["metadata"]["uid"] == victim)
    api.store.delete(RESOURCES["pods"], "default", name, {"gracePeriodSeconds": 0})  # its kubelet stopped it
    nominate(api, high, "g4")
    wait_until(lambda: used(extender) == 48, message="the victim gone")
    late = api.create(waiting("late", 8, priority=LOW))

    def late_refused() -> bool:
        status, body = extender.filter(late, "g4")
        return status == 200 and body["NodeNames"] == []

    wait_until(late_refused, message="the held GPU refused to a lower-priority pod")
    status, body = extender.filter(late, "g4")
    assert "held for a pod that preempted" in body["FailedNodes"]["g4"]
    status, body = extender.filter(high, "g4")
    assert body["NodeNames"] == ["g4"]
    status, bound = extender.bind(high, "g4")
    assert status == 200 and bound["Error"] == ""
    annotations = api.get("pods", "high", "default")["metadata"]["annotations"]  # type: ignore[index]
    assert annotations["ALIYUN_COM_GPU_MEM_IDX"] == "0"


def test_malformed_preemption_args_are_refused_precisely(extender: Extender) -> None:
    status, body = extender.post("preempt", {"Pod": {"metadata": {}}, "NodeNameToMetaVictims": {"g4": {"Pods": [{}]}}})
    assert status == 400 and "each victim must name a pod UID" in str(body)
    status, body = extender.post("preempt", {"Pod": {"metadata": {}}, "NodeNameToMetaVictims": []})
    assert status == 400 and "must map node names to victims" in str(body)


def test_one_namespace_evicts_at_most_the_cap_a_minute(api: FakeApiServer, spawn: Callable[..., Extender]) -> None:
    """With --max-evictions-per-minute 1, a namespace's second preemption in the minute gets no node, and waits;
    another namespace's preemptor is not held back by it."""
    extender = spawn(api, args=["--max-evictions-per-minute", "1"])
    extender.wait_ready()
    low = nine_low_pods(api, extender)
    theirs = {"g4": [low["low-4"]["metadata"]["uid"]]}
    first = api.create(waiting("first", 10, priority=HIGH))
    assert preempt(extender, first, theirs)["NodeNameToMetaVictims"]
    second = api.create(waiting("second", 10, priority=HIGH))
    assert preempt(extender, second, theirs) == {"NodeNameToMetaVictims": {}}
    other = {**waiting("other", 10, priority=HIGH), "metadata": {"name": "other", "namespace": "team-b"}}
    assert preempt(extender, api.create(other), theirs)["NodeNameToMetaVictims"]
    text = extender.get("/metrics")[1].decode()
    assert 'gpushared_extender_preemption_nodes_total{outcome="capped"} 1.0' in text


def test_victims_break_the_fewest_disruption_budgets(api: FakeApiServer, extender: Extender) -> None:
    """Of the two pods on GPU 0, the one a budget protects is spared; with both protected, two pods on a full
    GPU go instead of one protected pod (kube-scheduler's order: the lowest priority, then the fewest
    budgets broken, then the fewest pods), and the answer counts no violation."""
    low = nine_low_pods(api, extender)
    uid = {name: body["metadata"]["uid"] for name, body in low.items()}
    high = api.create(waiting("high", 10, priority=HIGH))
    [first] = [v["UID"] for v in preempt(extender, high, {"g4": []})["NodeNameToMetaVictims"]["g4"]["Pods"]]
    protected = next(name for name, u in uid.items() if u == first)
    other = "low-1" if protected == "low-0" else "low-0"
    protect(api, protected)

    def answer() -> dict[str, Any]:
        return preempt(extender, high, {"g4": []})["NodeNameToMetaVictims"]["g4"]  # type: ignore[no-any-return]

    wait_until(lambda: [v["UID"] for v in answer()["Pods"]] == [uid[other]], message="the protected pod spared")
    assert answer()["NumPDBViolations"] == 0
    protect(api, other)
    wait_until(lambda: len(answer()["Pods"]) == 2, message="two unprotected pods instead of one protected")
    victims = {next(n for n, u in uid.items() if u == v["UID"]) for v in answer()["Pods"]}
    assert victims <= {"low-2", "low-3", "low-4", "low-5", "low-6", "low-7"}, victims
    assert answer()["NumPDBViolations"] == 0
