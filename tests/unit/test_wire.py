"""kube-scheduler's extender JSON, golden: Go field names out, any case in."""

from __future__ import annotations

import json

import pytest

from gpushared.extender.http import wire

POD = {"metadata": {"name": "binpack-1", "namespace": "default", "uid": "u1"}, "spec": {"containers": []}}


def test_filter_result_matches_what_kube_scheduler_reads() -> None:
    """The shape of a real answer in Aliyun's issue #99 log, with our reason."""
    args = wire.parse_args(json.dumps({"Pod": POD, "Nodes": None, "NodeNames": ["n1", "n2"]}).encode(), verb="filter")
    result = wire.filter_result(args, passed=["n1"], failed={"n2": "GPU 0 has 3 GiB free, pod needs 4 GiB"})
    assert json.dumps(result, separators=(",", ":")) == (
        '{"Nodes":null,"NodeNames":["n1"],"FailedNodes":{"n2":"GPU 0 has 3 GiB free, pod needs 4 GiB"},'
        '"FailedAndUnresolvableNodes":{},"Error":""}'
    )


def test_keys_are_read_in_any_case() -> None:
    args = wire.parse_args(json.dumps({"pod": POD, "nodenames": ["a"]}).encode(), verb="filter")
    assert (args.pod, args.names) == (POD, ["a"])
    binding = wire.parse_binding(b'{"podname":"p","PODNAMESPACE":"d","PodUid":"u","node":"n"}')
    assert binding == wire.BindingArgs("p", "d", "u", "n")


def test_priorities_and_binding_results_use_go_names() -> None:
    assert wire.priority_list([("n1", 7)]) == [{"Host": "n1", "Score": 7}]
    assert wire.binding_result() == {"Error": ""}


def test_full_nodes_in_full_nodes_out() -> None:
    nodes = {"items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}]}
    args = wire.parse_args(json.dumps({"Pod": POD, "Nodes": nodes}).encode(), verb="filter")
    result = wire.filter_result(args, passed=["b"], failed={"a": "x"})
    assert result["Nodes"] == {"metadata": {}, "items": [{"metadata": {"name": "b"}}]}
    assert result["NodeNames"] is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"\xff", "filter: body is not JSON"),
        (b'{"Pod": {"metadata": {}}, "NodeNames": "a"}', "'NodeNames' must be a list"),
        (b'{"Pod": {"metadata": {}}, "Nodes": {"items": 3}}', "'Nodes' must be a NodeList"),
        (b'{"Pod": {"metadata": {}, "spec": 1}, "NodeNames": []}', "'Pod.spec' must be an object"),
    ],
)
def test_malformed(body: bytes, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.parse_args(body, verb="filter")
