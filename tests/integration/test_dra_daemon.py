"""The node daemon in DRA mode against the fakes: the fake API server serving resource.k8s.io/v1 (and
checking slices as kube-apiserver does), the fake kubelet's plugin watcher and DRA claim manager, fake NVML.
Claims are allocated by tests.fakes.dra (the scheduler's consumable-capacity arithmetic), then prepared and
unprepared by the fake kubelet over the real gRPC sockets (issue #44)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpushared.cli.daemon import render_status
from gpushared.contract import dra
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.fakes.dra import Invalid, allocate
from tests.fakes.drakubelet import Claim, FakeDraKubelet
from tests.fakes.kubelet import FakeKubelet
from tests.fakes.nvml import FakeNvml
from tests.fakes.store import RESOURCES
from tests.fakes.systemd import NotifySocket
from tests.harness import GPU_MEM, NODE, Daemon, node_body, wait_until

#: MiB: 16, 12, 24 and 8 GiB
SIZES = (16384, 12288, 24576, 8192)
NAMESPACE = "team"


@pytest.fixture
def world(kubelet_root: Path, fake_nvml_library: Path, tmp_path: Path) -> Iterator[tuple[Daemon, FakeDraKubelet]]:
    with (
        FakeApiServer() as api,
        FakeKubelet(kubelet_root, seed=1) as kubelet,
        FakeDraKubelet(kubelet_root) as dra_kubelet,
    ):
        api.create(node_body())
        api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        api.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": dra.DEVICE_CLASS},
                "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{dra.DRIVER}'"}}]},
            }
        )
        notify = NotifySocket(kubelet_root / "notify.sock")
        nvml = FakeNvml.with_sizes(tmp_path / "nvml.json", fake_nvml_library, *SIZES)
        daemon = Daemon(api=api, kubelet=kubelet, nvml=nvml, notify=notify, workdir=tmp_path)
        daemon.config = {"mode": "dra", "dra": {"cdiRoot": str(tmp_path / "cdi")}, "mps": {"enabled": False}}
        yield daemon, dra_kubelet
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.stop()
        notify.close()


def started(world: tuple[Daemon, FakeDraKubelet]) -> tuple[Daemon, FakeDraKubelet]:
    daemon, kubelet = world
    daemon.start()
    daemon.notify.wait_for("READY=1")
    kubelet.wait_for(dra.DRIVER)
    wait_until(lambda: daemon.api.objects("resourceslices"), message="the node's ResourceSlice")
    return daemon, kubelet


def the_slice(daemon: Daemon) -> dict[str, Any]:
    (body,) = daemon.api.objects("resourceslices")
    return body


def claim(
    daemon: Daemon, name: str, memory: str | None, *, compute: int | None = None, count: int = 1, mps: bool = False
) -> Claim:
    """A claim created and allocated as kube-scheduler allocates it; the kubelet's view of it."""
    capacity = {
        k: v for k, v in (("memory", memory), ("compute", None if compute is None else str(compute))) if v is not None
    }
    exactly: dict[str, Any] = {"deviceClassName": dra.DEVICE_CLASS, "allocationMode": "ExactCount", "count": count}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if mps:
        parameters = {"apiVersion": dra.CONFIG_API_VERSION, "kind": dra.CONFIG_KIND, "mps": True}
        spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": {"driver": dra.DRIVER, "parameters": parameters}}]
    body = daemon.api.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": spec,
        }
    )
    allocation = allocate(
        body,
        slices=daemon.api.objects("resourceslices"),
        claims=daemon.api.objects("resourceclaims"),
        classes={dra.DEVICE_CLASS: dra.DRIVER},
        node=NODE,
    )
    body["status"] = {"allocation": allocation}
    daemon.api.store.update(
        RESOURCES["resourceclaims"], NAMESPACE, name, body, subresource="status", precondition_rv=None
    )
    return Claim(NAMESPACE, name, body["metadata"]["uid"])


def cdi_spec(daemon: Daemon, uid: str) -> dict[str, Any]:
    return json.loads((daemon.workdir / "cdi" / f"gpushared.io-claim_{uid}.json").read_text())  # type: ignore[no-any-return]


def allocated_bytes(daemon: Daemon) -> dict[str, float]:
    """gpushared_gpu_memory_allocated_bytes by GPU index."""
    return {
        sample.labels["gpu"]: sample.value
        for family in text_string_to_metric_families(daemon.metrics_text())
        if family.name == "gpushared_gpu_memory_allocated_bytes"
        for sample in family.samples
    }


def claim_reads(daemon: Daemon) -> int:
    return sum(1 for r in daemon.api.requests if r.method == "GET" and "/resourceclaims/" in r.path)


def test_publishes_every_gpu_once_and_registers_with_the_newest_version(world: tuple[Daemon, FakeDraKubelet]) -> None:
    daemon, kubelet = started(world)
    body = the_slice(daemon)
    spec = body["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]) == (
        dra.DRIVER,
        NODE,
        {"name": NODE, "generation": 1, "resourceSliceCount": 1},
    )
    assert [d["capacity"]["memory"]["value"] for d in spec["devices"]] == ["16Gi", "12Gi", "24Gi", "8Gi"]
    assert [d["attributes"]["uuid"]["string"] for d in spec["devices"]] == [g.uuid for g in daemon.nvml.gpus]
    assert body["metadata"]["ownerReferences"][0]["kind"] == "Node"
    assert kubelet.plugins[dra.DRIVER].service == "v1.DRAPlugin"
    for socket in (kubelet.plugins[dra.DRIVER].registration_socket, Path(kubelet.plugins[dra.DRIVER].endpoint)):
        assert socket.stat().st_mode & 0o777 == 0o600
    assert not (daemon.kubelet.plugin_dir / "gpushared.sock").exists(), "a GPU is served by DRA or the device plugin"
    daemon.notify.wait_for("STATUS=serving 4 GPUs to DRA claims (0 prepared)")


def test_a_kubelet_that_speaks_only_v1beta1_gets_v1beta1(world: tuple[Daemon, FakeDraKubelet]) -> None:
    daemon, kubelet = world
    kubelet.speaks = ("v1beta1.DRAPlugin",)
    daemon, kubelet = started(world)
    assert kubelet.plugins[dra.DRIVER].service == "v1beta1.DRAPlugin"
    first = claim(daemon, "a", "4Gi")
    answer = kubelet.prepare(dra.DRIVER, first)[first.uid]
    assert not answer.error
    assert list(answer.devices[0].cdi_device_ids) == [f"gpushared.io/claim={first.uid}-gpu"]


def test_prepare_writes_the_cdi_spec_answers_again_from_the_checkpoint_and_unprepare_removes_it(
    world: tuple[Daemon, FakeDraKubelet],
) -> None:
    daemon, kubelet = started(world)
    first, second = claim(daemon, "a", "6Gi"), claim(daemon, "b", "6Gi")
    answers = kubelet.prepare(dra.DRIVER, first, second)
    assert {uid: a.error for uid, a in answers.items()} == {first.uid: "", second.uid: ""}
    device = answers[first.uid].devices[0]
    assert (device.pool_name, list(device.request_names)) == (NODE, ["gpu"])
    spec = cdi_spec(daemon, first.uid)
    edits = spec["devices"][0]["containerEdits"]
    assert spec["kind"] == "gpushared.io/claim"
    gpu = next(g for g in daemon.nvml.gpus if dra.device_name(g.uuid) == device.device_name)
    assert f"NVIDIA_VISIBLE_DEVICES={gpu.uuid}" in edits["env"]
    assert "ALIYUN_COM_GPU_MEM_CONTAINER=6" in edits["env"]
    assert any(d["path"].startswith("/dev/nvidia") and d["path"] != "/dev/nvidiactl" for d in edits["deviceNodes"])
    reads = claim_reads(daemon)
    again = kubelet.prepare(dra.DRIVER, first)
    assert again[first.uid] == answers[first.uid]
    assert claim_reads(daemon) == reads, "a prepared claim is answered from the checkpoint"
    assert kubelet.unprepare(dra.DRIVER, first) == {first.uid: ""}
    assert not (daemon.workdir / "cdi" / f"gpushared.io-claim_{first.uid}.json").exists()
    assert kubelet.unprepare(dra.DRIVER, first) == {first.uid: ""}, "unprepare is idempotent"
    claims = daemon.status()["claims"]
    assert [(c["name"], [d["memory"] for d in c["devices"]]) for c in claims] == [("b", [6])]
    # `gpushared status` and the GPU's memory gauge count DRA claims as they count device-plugin pods
    (left,) = claims[0]["devices"]
    status = daemon.status()
    assert next(g["used"] for g in status["gpus"] if g["index"] == left["gpu"]) == 6
    text = render_status(status)
    assert f"DRA driver ({dra.DRIVER})  kubelet: registered, slice published" in text
    assert f"{NAMESPACE}/b" in text and "gpu" in text
    _, public = daemon.public("/status")
    assert json.loads(public)["claims"] == 1 and f"{NAMESPACE}/b".encode() not in public
    wait_until(
        lambda: allocated_bytes(daemon).get(str(left["gpu"])) == 6 * 2**30,
        message="the claim's memory in gpushared_gpu_memory_allocated_bytes",
    )
    (sample,) = [
        s
        for family in text_string_to_metric_families(daemon.metrics_text())
        if family.name == "gpushared_claim_gpu_memory_bytes"
        for s in family.samples
    ]
    assert (sample.labels["namespace"], sample.labels["claim"], sample.value) == (NAMESPACE, "b", 6 * 2**30)
    _, public_metrics = daemon.public("/metrics")
    assert b"gpushared_claim_gpu_memory_bytes" not in public_metrics


def test_a_killed_daemon_comes_back_with_its_claims(world: tuple[Daemon, FakeDraKubelet]) -> None:
    daemon, kubelet = started(world)
    kept, gone = claim(daemon, "kept", "4Gi"), claim(daemon, "gone", "4Gi")
    answers = kubelet.prepare(dra.DRIVER, kept, gone)
    generation = the_slice(daemon)["spec"]["pool"]["generation"]
    assert daemon.process is not None
    os.kill(daemon.process.pid, signal.SIGKILL)
    daemon.process.wait()
    # What a crash between the two steps of unprepare leaves: the claim gone from the kubelet, its spec not.
    orphan = daemon.workdir / "cdi" / "gpushared.io-claim_not-in-the-checkpoint.json"
    orphan.write_text("{}")
    (daemon.workdir / "cdi" / f"gpushared.io-claim_{kept.uid}.json").unlink()  # and a spec lost
    daemon.start()
    daemon.notify.wait_for("READY=1")
    wait_until(lambda: not orphan.exists(), message="the spec no claim names removed")
    assert cdi_spec(daemon, kept.uid)["devices"][0]["name"] == f"{kept.uid}-gpu", "rewritten from the checkpoint"
    kubelet.wait_for(dra.DRIVER, times=2)  # the restarted daemon's registration, not the first one's
    daemon.api.inject(Fault(method="GET", path="/resourceclaims/", status=503, times=None))
    assert kubelet.prepare(dra.DRIVER, kept)[kept.uid] == answers[kept.uid], "answered without the API server"
    wait_until(lambda: daemon.api.objects("resourceslices"), message="slice")
    daemon.turns()
    assert the_slice(daemon)["spec"]["pool"]["generation"] == generation, "the same GPUs: the same generation"


def test_an_unhealthy_gpu_leaves_the_slice_and_comes_back(world: tuple[Daemon, FakeDraKubelet]) -> None:
    daemon, _ = started(world)
    daemon.nvml.xid(1, 79)
    wait_until(lambda: len(the_slice(daemon)["spec"]["devices"]) == 3, message="GPU 1 withdrawn")
    assert the_slice(daemon)["spec"]["pool"]["generation"] == 2
    wait_until(lambda: len(the_slice(daemon)["spec"]["devices"]) == 4, timeout=15, message="GPU 1 back")
    assert the_slice(daemon)["spec"]["pool"]["generation"] == 3


def test_what_does_not_fit_is_refused_with_the_reason(world: tuple[Daemon, FakeDraKubelet]) -> None:
    daemon, kubelet = started(world)
    whole = claim(daemon, "whole", None)  # no memory named: the whole GPU (GPU 0, 16 GiB)
    assert not kubelet.prepare(dra.DRIVER, whole)[whole.uid].error
    # The scheduler's arithmetic puts nothing beside it: 16 GiB fits the 24 GiB GPU once, then nowhere...
    claim(daemon, "big", "16Gi")
    with pytest.raises(Invalid, match="cannot allocate all claims"):
        claim(daemon, "another", "16Gi")
    # ...and a scheduler that puts something there anyway (no consumable capacity, a forged status) is refused.
    forged = daemon.api.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "forged", "namespace": NAMESPACE},
            "spec": {},
        }
    )
    device = the_slice(daemon)["spec"]["devices"][0]["name"]
    result = {
        "request": "gpu",
        "driver": dra.DRIVER,
        "pool": NODE,
        "device": device,
        "consumedCapacity": {"memory": "1Gi"},
    }
    forged["status"] = {"allocation": {"devices": {"results": [result]}}}
    daemon.api.store.update(
        RESOURCES["resourceclaims"], NAMESPACE, "forged", forged, subresource="status", precondition_rv=None
    )
    error = kubelet.prepare(dra.DRIVER, Claim(NAMESPACE, "forged", forged["metadata"]["uid"]))[
        forged["metadata"]["uid"]
    ].error
    assert "would bring GPU 0 to 17 GiB of 16 GiB" in error
    assert not (daemon.workdir / "cdi" / f"gpushared.io-claim_{forged['metadata']['uid']}.json").exists()


def test_hostile_and_stale_calls_get_precise_errors(world: tuple[Daemon, FakeDraKubelet]) -> None:
    daemon, kubelet = started(world)
    plugin = kubelet.plugins[dra.DRIVER]
    with pytest.raises(grpc.RpcError) as raised:
        kubelet.prepare(dra.DRIVER, Claim(NAMESPACE, "x", ""))
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "UID" in (raised.value.details() or "")
    for call in (kubelet.prepare, kubelet.unprepare):  # a UID names a file: never a path
        with pytest.raises(grpc.RpcError) as raised:
            call(dra.DRIVER, Claim(NAMESPACE, "x", "../../etc/passwd"))
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    missing = kubelet.prepare(dra.DRIVER, Claim(NAMESPACE, "nobody", "uid-x"))["uid-x"].error
    assert missing == f"claim {NAMESPACE}/nobody does not exist"
    real = claim(daemon, "recreated", "2Gi")
    stale = kubelet.prepare(dra.DRIVER, Claim(NAMESPACE, "recreated", "an-older-uid"))["an-older-uid"].error
    assert "is now another object" in stale
    daemon.api.inject(Fault(method="GET", path="/resourceclaims/", status=503, times=None))
    assert "503" in kubelet.prepare(dra.DRIVER, real)[real.uid].error
    assert plugin is kubelet.plugins[dra.DRIVER], "the daemon kept serving"
    assert daemon.process is not None and daemon.process.poll() is None


def test_a_deleted_registration_socket_is_served_again(world: tuple[Daemon, FakeDraKubelet]) -> None:
    _, kubelet = started(world)
    socket = kubelet.plugins[dra.DRIVER].registration_socket
    socket.unlink()
    wait_until(lambda: dra.DRIVER not in kubelet.plugins, message="deregistered")
    kubelet.wait_for(dra.DRIVER)
    kubelet.restart()
    kubelet.wait_for(dra.DRIVER)


def test_an_api_server_without_dra_stops_the_daemon_with_the_reason(world: tuple[Daemon, FakeDraKubelet]) -> None:
    daemon, _ = world
    daemon.api.dra_served = False
    daemon.start()
    assert daemon.wait_exit() != 0
    assert "mode: dra needs the API server to serve resource.k8s.io/v1 (Kubernetes 1.34 or later)" in daemon.log()


def test_a_node_back_in_device_plugin_mode_withdraws_its_slice(world: tuple[Daemon, FakeDraKubelet]) -> None:
    daemon, _ = started(world)
    daemon.stop()
    daemon.write_config(mode="device-plugin")
    daemon.start()
    daemon.kubelet.wait_for(GPU_MEM, capacity=16 + 12 + 24 + 8)
    wait_until(lambda: not daemon.api.objects("resourceslices"), message="the DRA slice deleted")


def test_a_slice_the_kubelet_wiped_is_published_again_when_it_registers_the_plugin(
    world: tuple[Daemon, FakeDraKubelet],
) -> None:
    """A restarting kubelet deletes the slices of drivers it has no plugin for yet, then finds the plugin
    again: the daemon looks at its slice on every registration and writes it again."""
    daemon, kubelet = started(world)
    name = the_slice(daemon)["metadata"]["name"]
    kubelet.stop()
    daemon.api.store.delete(RESOURCES["resourceslices"], "", name, {})
    assert not daemon.api.objects("resourceslices")
    kubelet.start()
    kubelet.wait_for(dra.DRIVER)
    wait_until(lambda: daemon.api.objects("resourceslices"), message="the slice published again")
    assert len(the_slice(daemon)["spec"]["devices"]) == 4


def test_a_second_daemon_on_the_node_is_refused_and_the_first_keeps_its_claims(
    world: tuple[Daemon, FakeDraKubelet], tmp_path: Path
) -> None:
    daemon, kubelet = started(world)
    first = claim(daemon, "first", "10Gi")
    assert not kubelet.prepare(dra.DRIVER, first)[first.uid].error
    (tmp_path / "second").mkdir()
    second = Daemon(
        api=daemon.api, kubelet=daemon.kubelet, nvml=daemon.nvml, notify=daemon.notify, workdir=tmp_path / "second"
    )
    second.config = daemon.config
    second.start()
    assert second.wait_exit() == 2
    assert "another gpushared already serves DRA on this node (process " in second.log()
    assert cdi_spec(daemon, first.uid)["devices"][0]["name"] == f"{first.uid}-gpu"
    late = claim(daemon, "late", "6Gi")
    assert not kubelet.prepare(dra.DRIVER, late)[late.uid].error, "the first still serves"


def test_a_damaged_checkpoint_record_is_set_aside_with_an_event_and_the_daemon_starts(
    world: tuple[Daemon, FakeDraKubelet],
) -> None:
    daemon, kubelet = started(world)
    kept, broken = claim(daemon, "kept", "4Gi"), claim(daemon, "broken", "4Gi")
    assert not any(a.error for a in kubelet.prepare(dra.DRIVER, kept, broken).values())
    daemon.stop()
    record = kubelet.root / "plugins" / dra.DRIVER / "claims" / f"{broken.uid}.json"
    record.write_bytes(b"\xff" + record.read_bytes())
    daemon.start()
    daemon.notify.wait_for("READY=1")
    wait_until(
        lambda: any(e.get("reason") == "DRACheckpointDamaged" for e in daemon.api.objects("events")),
        message="the node's Event",
    )
    assert record.with_name(record.name + ".unreadable").exists()
    # the driver posts the Event while it starts, a moment before the daemon's status shows its claims
    claims = wait_until(lambda: daemon.status()["claims"], message="the driver's claims in the status")
    assert [c["name"] for c in claims] == ["kept"]
    assert cdi_spec(daemon, broken.uid), "its pod's containers may still need the spec"


def test_the_containers_of_a_claim_share_its_memory(world: tuple[Daemon, FakeDraKubelet]) -> None:
    """Issue #52, item 8: each container of a pod whose two containers use one claim got all of its memory.
    The driver reads the pods the claim is reserved for and gives each container its part."""
    daemon, kubelet = started(world)
    shared = claim(daemon, "shared", "6Gi")
    body = daemon.api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "two", "namespace": NAMESPACE},
            "spec": {
                "nodeName": NODE,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "shared"}],
                "containers": [
                    {"name": c, "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}} for c in ("a", "b")
                ],
            },
        }
    )
    stored = daemon.api.get("resourceclaims", "shared", NAMESPACE)
    assert stored is not None
    stored["status"]["reservedFor"] = [{"resource": "pods", "name": "two", "uid": body["metadata"]["uid"]}]
    daemon.api.store.update(
        RESOURCES["resourceclaims"], NAMESPACE, "shared", stored, subresource="status", precondition_rv=None
    )
    assert not kubelet.prepare(dra.DRIVER, shared)[shared.uid].error
    env = cdi_spec(daemon, shared.uid)["devices"][0]["containerEdits"]["env"]
    assert "ALIYUN_COM_GPU_MEM_CONTAINER=3" in env, env
    (prepared,) = daemon.status()["claims"]
    assert prepared["devices"][0]["memory"] == 6, "the claim holds all 6 GiB of the GPU"
