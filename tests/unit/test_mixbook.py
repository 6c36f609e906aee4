"""The request mix's book and the operator's expected mix (issue #41): what a mix may know, read exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpushared.contract import ContractError
from gpushared.core.placement.mixbook import (
    EXPECTED_WEIGHT,
    MAX_EXPECTED_KINDS,
    ExpectedMix,
    MixBook,
    expected_mix_document,
    read_expected_mix,
)

V100 = frozenset({"V100"})


def test_an_expected_mix_round_trips_through_its_document() -> None:
    counts = {(4000, 8192, 1, None): 30.0, (96000, 32768, 8, V100): 2.0, (2000, 0, 0, None): 8.0}
    document = expected_mix_document(counts, weight=500)
    assert document["kinds"][0] == {"cpuMilli": 4000, "gpuMem": 8192, "gpus": 1, "count": 30.0}  # largest first
    expected = read_expected_mix(json.loads(json.dumps(document)))
    assert expected.weight == 500
    assert expected.shares == {kind: n / 40 for kind, n in counts.items()}
    assert expected.counts()[(96000, 32768, 8, V100)] == pytest.approx(25.0)


def test_a_kind_without_gpus_names_no_models_and_defaults_apply() -> None:
    expected = read_expected_mix({"kinds": [{"cpuMilli": 1000}, {"gpuMem": 4, "gpus": 1, "models": ["T4"]}]})
    assert expected.weight == EXPECTED_WEIGHT
    assert expected.shares == {(1000, 0, 0, None): 0.5, (0, 4, 1, frozenset({"T4"})): 0.5}
    assert read_expected_mix({"kinds": []}).shares == {}


@pytest.mark.parametrize(
    ("document", "key", "reason"),
    [
        ([], "expected mix", "JSON object"),
        ({"kinds": [], "mix": 1}, "expected mix", "unknown keys"),
        ({"weight": -1, "kinds": []}, "expected mix: weight", "number of pods"),
        ({"weight": True, "kinds": []}, "expected mix: weight", "number of pods"),
        ({"weight": float("nan"), "kinds": []}, "expected mix: weight", "number of pods"),
        ({"kinds": {}}, "expected mix: kinds", "list"),
        ({"kinds": [{}] * (MAX_EXPECTED_KINDS + 1)}, "expected mix: kinds", "at most"),
        ({"kinds": ["4"]}, "expected mix: kinds[0]", "an object"),
        ({"kinds": [{"cpuMilli": 1, "size": 4}]}, "expected mix: kinds[0]", "unknown keys"),
        ({"kinds": [{"cpuMilli": "4"}]}, "expected mix: kinds[0].cpuMilli", "integer"),
        ({"kinds": [{"cpuMilli": 1.5}]}, "expected mix: kinds[0].cpuMilli", "integer"),
        ({"kinds": [{"gpuMem": 10**10, "gpus": 1}]}, "expected mix: kinds[0].gpuMem", "integer"),
        ({"kinds": [{"gpuMem": 4, "gpus": 2000}]}, "expected mix: kinds[0].gpus", "integer"),
        ({"kinds": [{"gpuMem": 4}]}, "expected mix: kinds[0]", "both 0"),
        ({"kinds": [{"gpus": 1}]}, "expected mix: kinds[0]", "both 0"),
        ({"kinds": [{"cpuMilli": 1, "count": -2}]}, "expected mix: kinds[0].count", "number"),
        ({"kinds": [{"cpuMilli": 1, "count": float("inf")}]}, "expected mix: kinds[0].count", "number"),
        ({"kinds": [{"gpuMem": 4, "gpus": 1, "models": "T4"}]}, "expected mix: kinds[0].models", "model names"),
        ({"kinds": [{"gpuMem": 4, "gpus": 1, "models": []}]}, "expected mix: kinds[0].models", "model names"),
        ({"kinds": [{"gpuMem": 4, "gpus": 1, "models": [7]}]}, "expected mix: kinds[0].models", "model names"),
        ({"kinds": [{"cpuMilli": 1, "count": 0}]}, "expected mix: kinds", "every count is 0"),
    ],
)
def test_a_bad_expected_mix_is_refused_naming_the_entry(document: Any, key: str, reason: str) -> None:
    with pytest.raises(ContractError) as raised:
        read_expected_mix(document)
    assert raised.value.key == key and reason in raised.value.reason


def test_a_book_counts_the_expected_mix_beside_the_pods_seen() -> None:
    expected = ExpectedMix.of_counts({(96000, 8, 8, None): 1, (4000, 4, 1, None): 3}, weight=100)
    book = MixBook(expected)
    first = book.take(nodes={})
    assert first.kinds() == {(96000, 8, 8, None): 25.0, (4000, 4, 1, None): 75.0}  # before any pod is seen
    for _ in range(300):
        book.count((4000, 4, 1, None))
    book.count((1000, 2, 1, V100))
    assert book.take(nodes={}).kinds() == {(96000, 8, 8, None): 25.0, (4000, 4, 1, None): 375.0, (1000, 2, 1, V100): 1}
    book.uncount((1000, 2, 1, V100))
    for _ in range(300):
        book.uncount((4000, 4, 1, None))
    assert book.take(nodes={}).kinds() == first.kinds()  # the pods gone, the expected mix stays
    assert MixBook().take(nodes={}).kinds() == {}  # without one, a fresh book knows nothing


def test_the_extenders_state_counts_its_expected_mix_before_any_pod() -> None:
    """``--expected-mix`` reaches the extender's cluster state: its first mix, with no node or pod seen yet,
    is the operator's (the same book the replay counts with)."""
    from gpushared.contract import ResourceNames
    from gpushared.extender.state import ClusterState

    expected = ExpectedMix.of_counts({(8000, 16, 2, None): 1}, weight=10)
    state = ClusterState(resources=ResourceNames(), clock=lambda: 1000.0, expected=expected)
    assert state.request_mix().kinds() == {(8000, 16, 2, None): 10.0}
    assert ClusterState(resources=ResourceNames(), clock=lambda: 1000.0).request_mix().kinds() == {}
