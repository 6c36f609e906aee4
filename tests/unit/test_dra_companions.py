"""A container given several claims of the driver is told every GPU of them, whatever order the runtime applies
their CDI devices in (core.dra.companions, core.dra.prepare.decide_all, the daemon's DraDriver).

The runtime applies a container's CDI devices one after the other, and a variable set by two keeps the last
value: a container with two 6 GiB claims on two GPUs was told one GPU in NVIDIA_VISIBLE_DEVICES and
ALIYUN_COM_GPU_MEM_*. Here the runtime is :func:`applied`, containerd's order and its opposite; the claims
are prepared as the daemon prepares them, and where containers combine claims so that no spec can tell each
its own GPUs, the claims are refused with the reason."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpushared.core.dra.allocated import ClaimRef
from gpushared.core.dra.allowances import combination_problem
from gpushared.core.dra.checkpoint import format_checkpoint, parse_checkpoint
from gpushared.core.dra.companions import DriverClaim, companions
from gpushared.core.dra.prepare import ClaimRead, DraNode, PreparedClaim, PrepareRefusal, cdi_spec, decide_all
from gpushared.core.node.exposure import ExposurePolicy, Strategy
from gpushared.daemon.dra.driver import DraDriver
from gpushared.kube.errors import NotFound
from tests.unit.test_dra_book import book_at_loaded, node_facts
from tests.unit.test_dra_prepare import G0, G1, MPS_CONFIG, NODE, opaque, result

A, B, C = (ClaimRef("team", name, f"uid-{name}") for name in ("a", "b", "c"))


def claim_of(ref: ClaimRef, *results: dict[str, Any], config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"results": list(results)}
    if config is not None:
        devices["config"] = config
    return {
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {"allocation": {"devices": devices}},
    }


def pod(name: str, *containers: tuple[str, list[str]], init: Sequence[tuple[str, list[str]]] = ()) -> dict[str, Any]:
    """A pod whose containers name claims by the claims' own names (the pod's name for each is the same)."""
    named = sorted({c for _, claims in [*containers, *init] for c in claims})

    def container(name: str, claims: list[str]) -> dict[str, Any]:
        return {"name": name, "resources": {"claims": [{"name": c} for c in claims]}}

    return {
        "metadata": {"namespace": "team", "name": name, "uid": f"pod-{name}"},
        "spec": {
            "resourceClaims": [{"name": c, "resourceClaimName": c} for c in named],
            "initContainers": [container(n, c) for n, c in init],
            "containers": [container(n, c) for n, c in containers],
        },
    }


def applied(specs: Sequence[Mapping[str, Any]], ids: Sequence[str]) -> dict[str, str]:
    """The variables a container ends with when the runtime applies these CDI devices in this order: each
    device's env in turn, a variable set again keeping the last value (containerd's CDI)."""
    devices = {f"{spec['kind']}={d['name']}": d for spec in specs for d in spec["devices"]}
    env: dict[str, str] = {}
    for cdi_id in ids:
        for line in devices[cdi_id]["containerEdits"].get("env", []):
            name, _, value = line.partition("=")
            env[name] = value
    return env


def given(*claims: PreparedClaim) -> list[str]:
    """The CDI devices the kubelet gives a container that names these claims whole."""
    return [cdi_id for claim in claims for device in claim.devices for cdi_id in device.cdi_device_ids]


def prepared_all(reads: Sequence[ClaimRead], node: DraNode = NODE) -> dict[str, PreparedClaim]:
    outcomes = decide_all(reads, node)
    assert all(isinstance(o, PreparedClaim) for o in outcomes.values()), outcomes
    return {uid: o for uid, o in outcomes.items() if isinstance(o, PreparedClaim)}


def refusals(reads: Sequence[ClaimRead], node: DraNode = NODE) -> dict[str, str]:
    outcomes = decide_all(reads, node)
    return {uid: o.message for uid, o in outcomes.items() if isinstance(o, PrepareRefusal)}


# --- one container, two claims: told both GPUs whatever the order -------------------------------------------


def test_a_container_with_two_claims_is_told_both_gpus_in_either_order() -> None:
    app = pod("p", ("app", ["a", "b"]))
    done = prepared_all(
        [
            ClaimRead(A, claim_of(A, result(G0, "6Gi")), [app]),
            ClaimRead(B, claim_of(B, result(G1, "6Gi")), [app]),
        ]
    )
    a, b = done[A.uid], done[B.uid]
    specs = [cdi_spec(a), cdi_spec(b)]
    for order in (given(a, b), given(b, a)):
        env = applied(specs, order)
        assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0aaa,GPU-1bbb"
        assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0,1"
        assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "12"  # 6 GiB of each
        assert env["ALIYUN_COM_GPU_MEM_DEV"] == "15"
        # each claim's own variable: set by its device alone
        assert env["GPUSHARED_CLAIM_UIDA_GPU"] == "GPU-0aaa"
        assert env["GPUSHARED_CLAIM_UIDB_GPU"] == "GPU-1bbb"
    assert [c.companions for c in a.cdi] == [("uid-a-gpu", "uid-b-gpu")]
    assert [c.companions for c in b.cdi] == [("uid-a-gpu", "uid-b-gpu")]
    # the record keeps the companions, so a restarted daemon writes the same specs
    assert parse_checkpoint(format_checkpoint([a, b])) == [a, b]


def test_two_claims_on_one_gpu_name_it_once_and_add_up_their_memory() -> None:
    app = pod("p", ("app", ["a", "b"]))
    done = prepared_all(
        [
            ClaimRead(A, claim_of(A, result(G1, "6Gi")), [app]),
            ClaimRead(B, claim_of(B, result(G1, "4Gi")), [app]),
        ]
    )
    env = applied([cdi_spec(c) for c in done.values()], given(*done.values()))
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["ALIYUN_COM_GPU_MEM_IDX"]) == ("GPU-1bbb", "1")
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "10"


def test_two_requests_of_one_claim_used_whole_are_told_both_and_a_request_alone_its_own() -> None:
    whole = pod("p", ("app", ["a"]))
    (two,) = prepared_all(
        [ClaimRead(A, claim_of(A, result(G0, request="x"), result(G1, request="y")), [whole])]
    ).values()
    env = applied([cdi_spec(two)], list(reversed(given(two))))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0aaa,GPU-1bbb"
    # the same claim with a container naming only request x: one spec cannot say both
    alone = pod("q", ("app", ["a"]))
    alone["spec"]["containers"][0]["resources"]["claims"] = [{"name": "a", "request": "x"}]
    found = refusals([ClaimRead(A, claim_of(A, result(G0, request="x"), result(G1, request="y")), [whole, alone])])
    assert "cannot tell each its own GPUs" in found[A.uid]


def test_the_volume_mounts_strategy_keeps_each_gpu_a_mount_of_its_own_claim() -> None:
    node = DraNode(**{**NODE.__dict__, "exposure": ExposurePolicy(strategies=frozenset({Strategy.VOLUME_MOUNTS}))})
    app = pod("p", ("app", ["a", "b"]))
    done = prepared_all(
        [ClaimRead(A, claim_of(A, result(G0)), [app]), ClaimRead(B, claim_of(B, result(G1)), [app])], node
    )
    a, b = done[A.uid].cdi[0], done[B.uid].cdi[0]
    assert a.env["NVIDIA_VISIBLE_DEVICES"] == b.env["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert [m.container_path for m in a.mounts] == ["/var/run/nvidia-container-devices/GPU-0aaa"]
    assert [m.container_path for m in b.mounts] == ["/var/run/nvidia-container-devices/GPU-1bbb"]


def test_another_drivers_claim_beside_it_changes_nothing() -> None:
    app = pod("p", ("app", ["a", "nic"]))
    (a,) = prepared_all([ClaimRead(A, claim_of(A, result(G0)), [app])]).values()
    assert a.cdi[0].companions == ()
    assert a.cdi[0].env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0aaa"


# --- containers that combine a claim differently: refused, saying which --------------------------------------


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        pytest.param(
            [pod("p", ("both", ["a", "b"]), ("only-a", ["a"]))],
            "container both of pod team/p uses claims team/a (request gpu), team/b (request gpu) and container "
            "only-a of pod team/p uses claim team/a (request gpu)",
            id="two containers of one pod",
        ),
        pytest.param(
            [pod("p", ("both", ["a", "b"])), pod("q", ("only-a", ["a"]))],
            "container only-a of pod team/q uses claim team/a",
            id="two pods sharing claim a",
        ),
        pytest.param(
            [pod("p", ("app", ["a", "b"]), init=[("setup", ["a"])])],
            "container setup of pod team/p uses claim team/a (request gpu) and container app",
            id="an init container with one of them",
        ),
    ],
)
def test_a_claim_its_containers_combine_differently_is_refused_with_both_containers(
    pods: list[dict[str, Any]], expected: str
) -> None:
    found = refusals([ClaimRead(A, claim_of(A, result(G0)), pods), ClaimRead(B, claim_of(B, result(G1)), pods[:1])])
    assert set(found) == {A.uid, B.uid}, "neither is prepared: no container is told a GPU it does not hold"
    assert expected in found[A.uid]
    assert "give every container that uses a claim the same claims" in found[A.uid]


def test_containers_that_combine_alike_share_the_claims() -> None:
    pods = [pod("p", ("app", ["a", "b"]), ("sidecar", ["a", "b"])), pod("q", ("app", ["a", "b"]))]
    done = prepared_all(
        [ClaimRead(A, claim_of(A, result(G0, "6Gi")), pods), ClaimRead(B, claim_of(B, result(G1, "6Gi")), pods)]
    )
    env = applied([cdi_spec(c) for c in done.values()], given(*done.values()))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0aaa,GPU-1bbb"
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"  # 2 of each claim's 6 GiB: three containers share each


def test_a_later_pod_combining_a_prepared_claim_otherwise_is_refused() -> None:
    first = pod("p", ("app", ["a"]))
    (a,) = prepared_all([ClaimRead(A, claim_of(A, result(G0)), [first])]).values()
    later = pod("q", ("app", ["a", "b"]))
    node = DraNode(**{**NODE.__dict__, "prepared": [a]})
    found = refusals([ClaimRead(B, claim_of(B, result(G1)), [later])], node)
    assert (
        "container app of pod team/q uses claims team/a (request gpu), team/b (request gpu), but team/a" in found[B.uid]
    )
    assert "was prepared for containers that use claim team/a (request gpu)" in found[B.uid]
    # combined as its spec was written, it is prepared
    again = pod("r", ("app", ["a"]), ("other", ["b"]))
    assert set(prepared_all([ClaimRead(B, claim_of(B, result(G1)), [again])], node)) == {B.uid}


def test_a_claim_used_beside_one_refused_or_unread_is_refused_too() -> None:
    app = pod("p", ("app", ["a", "b"]))
    past = refusals(
        [ClaimRead(A, claim_of(A, result(G0)), [app]), ClaimRead(B, claim_of(B, result("gpu-gone")), [app])]
    )
    assert "does not have" in past[B.uid]
    assert "uses claim team/b beside claim team/a (request gpu), and it cannot be prepared now" in past[A.uid]
    unread = decide_all([ClaimRead(A, claim_of(A, result(G0)), [app])], NODE, unread=[B])
    assert isinstance(unread[A.uid], PrepareRefusal) and "claim team/b" in unread[A.uid].message
    # refused once its spec is made: GPU 1's device file is missing
    no_file = DraNode(**{**NODE.__dict__, "present_devices": ("/dev/nvidia0", "/dev/nvidiactl")})
    late = refusals(
        [ClaimRead(A, claim_of(A, result(G0)), [app]), ClaimRead(B, claim_of(B, result(G1)), [app])], no_file
    )
    assert "does not exist" in late[B.uid]
    assert "claim team/a is used beside claim team/b, which cannot be prepared now" in late[A.uid]


def test_an_mps_claim_with_a_companion_is_refused() -> None:
    app = pod("p", ("app", ["a", "b"]))
    found = refusals(
        [
            ClaimRead(A, claim_of(A, result(G0, "2Gi"), config=[opaque(MPS_CONFIG)]), [app]),
            ClaimRead(B, claim_of(B, result(G1)), [app]),
        ]
    )
    assert set(found) == {A.uid, B.uid} and "one of them as an MPS client" in found[A.uid]


def test_companions_names_what_each_device_is_given_with() -> None:
    claims = {("team", r.name): DriverClaim(r, ("gpu",)) for r in (A, B, C)}
    found = companions([pod("p", ("app", ["a", "b"]), ("solo", ["c"]))], claims)
    assert found.problems == {}
    assert found.of == {
        "uid-a-gpu": {"uid-a-gpu", "uid-b-gpu"},
        "uid-b-gpu": {"uid-a-gpu", "uid-b-gpu"},
        "uid-c-gpu": {"uid-c-gpu"},
    }


def test_a_record_without_companions_is_its_device_alone() -> None:
    (a,) = prepared_all([ClaimRead(A, claim_of(A, result(G0)))]).values()
    text = format_checkpoint([a]).replace('"companions": [],', "")
    assert '"companions"' not in text
    (back,) = parse_checkpoint(text)
    assert back.cdi[0].combination == {"uid-a-gpu"}


# --- the daemon's driver: read the claims and their pods, write the specs -------------------------------------


class Api:
    def __init__(self, claims: Mapping[str, dict[str, Any]]) -> None:
        self.claims = dict(claims)

    def get_claim(self, namespace: str, name: str, *, timeout: float) -> dict[str, Any]:
        if name not in self.claims:
            raise NotFound(f"get ResourceClaim {namespace}/{name}: 404", status=404)
        return self.claims[name]


def reserved(body: dict[str, Any], *pods: dict[str, Any]) -> dict[str, Any]:
    body["status"]["reservedFor"] = [
        {"resource": "pods", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]} for p in pods
    ]
    return body


def test_the_daemon_tells_a_container_with_two_claims_both_gpus(tmp_path: Path) -> None:
    """As on the cluster: the kubelet names the pod's two claims in one call; the container's variables, as the
    runtime leaves them after applying both written specs in either order, name both GPUs."""
    app = pod("p", ("app", ["a", "b"]))
    api = Api({"a": reserved(claim_of(A, result(G0, "6Gi")), app), "b": reserved(claim_of(B, result(G1, "6Gi")), app)})
    facts = node_facts()
    driver = DraDriver(
        node="n1",
        api=api,  # type: ignore[arg-type]
        book=book_at_loaded(tmp_path),
        facts=lambda: facts,
        read_pod=lambda namespace, name, timeout: app,
    )
    answers = driver.prepare([A, B])
    a, b = answers[A.uid], answers[B.uid]
    assert isinstance(a, PreparedClaim) and isinstance(b, PreparedClaim)
    written = [json.loads(driver.book.cdi_path(uid).read_text()) for uid in (A.uid, B.uid)]
    for order in (given(a, b), given(b, a)):
        env = applied(written, order)
        assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0aaa,GPU-1bbb"
        assert (env["ALIYUN_COM_GPU_MEM_IDX"], env["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("0,1", "12")


def test_the_watcher_names_a_running_pod_that_combines_prepared_claims_otherwise() -> None:
    app = pod("p", ("app", ["a", "b"]))
    done = prepared_all([ClaimRead(A, claim_of(A, result(G0)), [app]), ClaimRead(B, claim_of(B, result(G1)), [app])])
    book = {("team", c.ref.name): c for c in done.values()}
    later = pod("q", ("app", ["a"]))
    assert combination_problem(later, book) is None, "not running yet: its claims may still be being prepared"
    later["status"] = {"phase": "Running"}
    app["status"] = {"phase": "Running"}
    assert combination_problem(app, book) is None
    problem = combination_problem(later, book)
    assert problem is not None and problem.startswith(
        "container app of pod team/q uses claim team/a (request gpu), but"
    )
