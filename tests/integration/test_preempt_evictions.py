"""Preemption the extender does itself, where kube-scheduler never calls its preempt verb (1.20.0-1.20.8,
1.21.0-1.21.2): the victims that free a GPU evicted through the Eviction API, PodDisruptionBudgets honoured,
the freed GPU held for the preemptor, each victim told why."""

from __future__ import annotations

import time
from typing import Any

from tests.extender_harness import Extender
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.fakes.store import RESOURCES
from tests.harness import protect, wait_until
from tests.integration.test_preempt_verb import HIGH, LOW, api, nine_low_pods, placed, preempt, used, waiting

__all__ = ["api"]


def terminating(api: FakeApiServer) -> list[str]:
    return sorted(
        p["metadata"]["name"] for p in api.objects("pods") if p["metadata"].get("deletionTimestamp") is not None
    )


def events(api: FakeApiServer, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.objects("events") if e.get("reason") == reason]


def test_a_pod_that_fits_nowhere_gets_the_pods_on_one_gpu_evicted(api: FakeApiServer, extender: Extender) -> None:
    low = nine_low_pods(api, extender)
    high = api.create(waiting("high", 10, priority=HIGH))
    wait_until(lambda: terminating(api), timeout=20, message="a victim evicted")
    (victim,) = terminating(api)
    assert victim in ("low-0", "low-1")  # the two 6 GiB pods on the 16 GiB GPU 0
    wait_until(lambda: events(api, "Preempted"), message="the victim told")
    assert [e["involvedObject"]["name"] for e in events(api, "Preempted")] == [victim]
    assert "for pod default/high" in events(api, "Preempted")[0]["message"]
    # its kubelet stops it; then the freed GPU is the preemptor's alone
    api.store.delete(RESOURCES["pods"], "default", victim, {"gracePeriodSeconds": 0})
    wait_until(lambda: used(extender) == 48, message="the victim gone")
    late = api.create(waiting("late", 8, priority=LOW))
    assert extender.filter(late, "g4")[1]["NodeNames"] == []
    assert extender.filter(high, "g4")[1]["NodeNames"] == ["g4"]
    assert extender.bind(high, "g4")[1]["Error"] == ""
    assert api.get("pods", "high", "default")["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] == "0"  # type: ignore[index]
    assert len(low) - len(terminating(api)) == 9  # no other pod went
    text = extender.get("/metrics")[1].decode()
    assert 'gpushared_extender_evictions_total{outcome="evicted"} 1.0' in text


def test_pods_a_budget_protects_are_spared_where_others_free_the_room(api: FakeApiServer, extender: Extender) -> None:
    """Both pods on GPU 0 protected: two pods on a full GPU go instead (the fewest budgets broken first)."""
    low = nine_low_pods(api, extender)
    protect(api, "low-0", "low-1")
    time.sleep(1)  # the budget's watch event reaches the extender (its process shows no budgets to ask)
    api.create(waiting("high", 10, priority=HIGH))
    wait_until(lambda: len(terminating(api)) == 2, timeout=20, message="two victims evicted")
    assert set(terminating(api)) in (
        {"low-2", "low-3"},
        {"low-4", "low-5"},
        {"low-4", "low-6"},
        {"low-4", "low-7"},
        {"low-5", "low-6"},
        {"low-5", "low-7"},
        {"low-6", "low-7"},
    )
    assert len(low) == 9


def test_a_disruption_budget_that_allows_none_stops_the_eviction(api: FakeApiServer, extender: Extender) -> None:
    """Every pod protected: the set chosen breaks a budget, and the Eviction API refuses it."""
    low = nine_low_pods(api, extender)
    protect(api, *low)
    api.create(waiting("high", 10, priority=HIGH))

    def refused() -> bool:
        return 'gpushared_extender_evictions_total{outcome="refused"} 1.0' in extender.get("/metrics")[1].decode()

    wait_until(refused, timeout=20, message="the eviction refused")
    assert terminating(api) == [] and len(low) == 9


def test_a_pod_kube_scheduler_preempts_for_is_left_to_it(api: FakeApiServer, extender: Extender) -> None:
    """Where kube-scheduler calls the verb, the extender evicts nothing itself: kube-scheduler does, once."""
    low = nine_low_pods(api, extender)
    high = api.create(waiting("high", 10, priority=HIGH))
    assert preempt(extender, high, {"g4": [low["low-4"]["metadata"]["uid"]]})["NodeNameToMetaVictims"]
    time.sleep(8)  # past the grace the extender gives kube-scheduler's own preemption
    assert terminating(api) == []


def test_a_pod_whose_class_never_preempts_evicts_nothing(api: FakeApiServer, extender: Extender) -> None:
    nine_low_pods(api, extender)
    body = waiting("polite", 10, priority=HIGH)
    body["spec"]["preemptionPolicy"] = "Never"  # as the API server copies it from the pod's PriorityClass
    api.create(body)
    time.sleep(8)  # past the grace the extender gives kube-scheduler's own preemption
    assert terminating(api) == []


def test_an_eviction_that_lands_though_its_answer_is_lost_is_not_repeated(
    api: FakeApiServer, extender: Extender
) -> None:
    """The eviction lands but the connection is cut before its answer: the hold stays, and no second pod is
    evicted for the preemptor while the first terminates (past the 10 s a refused attempt waits)."""
    nine_low_pods(api, extender)
    api.inject(Fault(method="POST", path=r"/eviction$", cut=True, applied=True))
    api.create(waiting("high", 10, priority=HIGH))
    wait_until(lambda: terminating(api), timeout=20, message="the eviction landed")
    time.sleep(15)
    assert len(terminating(api)) == 1
    text = extender.get("/metrics")[1].decode()  # tried once: failed as the client saw it, never again
    assert 'gpushared_extender_evictions_total{outcome="failed"} 1.0' in text
    assert 'gpushared_extender_evictions_total{outcome="evicted"} 0.0' in text


def test_pods_already_terminating_that_free_the_room_are_waited_for(api: FakeApiServer, extender: Extender) -> None:
    """A previous leader's eviction (a pod on GPU 0 terminating) frees the room: neither path evicts more."""
    low = nine_low_pods(api, extender)
    api.store.delete(RESOURCES["pods"], "default", "low-0", {"gracePeriodSeconds": 30})  # terminating, for 30 s
    api.create(placed("marker", 2, 3))  # watched after the deletion's mark: once counted, the mark is seen too
    wait_until(lambda: used(extender) == 56, message="the marker, and so the mark, watched")
    high = api.create(waiting("high", 10, priority=HIGH))
    answer = preempt(extender, high, {"g4": [low["low-4"]["metadata"]["uid"]]})
    assert answer == {"NodeNameToMetaVictims": {"g4": {"Pods": [], "NumPDBViolations": 0}}}
    api.create(waiting("other", 10, priority=HIGH))  # never asked about: the extender's own path
    time.sleep(8)  # past the grace the extender gives kube-scheduler's own preemption
    assert terminating(api) == ["low-0"]
