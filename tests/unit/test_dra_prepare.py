"""NodePrepareResources decided (core.dra.prepare, core.dra.allocated): one row per refusal, and what containers get
(the CDI spec) for a fractional claim, an MPS claim and a two-GPU claim."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from gpushared.contract import ContractError, GpuInfo, GpuInventory, MemoryUnit, dra
from gpushared.core.dra.allocated import ClaimRef, allocated_devices
from gpushared.core.dra.allowances import claim_allowances
from gpushared.core.dra.checkpoint import format_checkpoint, parse_checkpoint
from gpushared.core.dra.claimusers import claim_users
from gpushared.core.dra.prepare import DraNode, PreparedClaim, PrepareRefusal, cdi_spec, decide
from gpushared.core.node.allocate import MpsDaemon
from gpushared.core.node.exposure import ExposurePolicy, Strategy
from gpushared.core.node.memory import Allowance, Enforcement

GPUS = (
    GpuInfo(0, "GPU-0aaa", "T4", 15, 15360, mps_capable=True),
    GpuInfo(1, "GPU-1bbb", "T4", 15, 15360),
    GpuInfo(2, "GPU-2ccc", "T4", 15, 15360, healthy=False),
)
INVENTORY = GpuInventory(unit=MemoryUnit.GIB, gpus=GPUS)
G0, G1, G2 = (dra.device_name(g.uuid) for g in GPUS)
REF = ClaimRef("team", "train", "uid-1")
PRESENT = ("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl")
MPS = {"GPU-0aaa": MpsDaemon(pipe="/run/gpushared/mps/GPU-0aaa/pipe", shm="/run/gpushared/mps/GPU-0aaa/shm")}
NODE = DraNode(
    name="n1",
    inventory=INVENTORY,
    minors={"GPU-0aaa": 0, "GPU-1bbb": 1, "GPU-2ccc": 2},
    present_devices=PRESENT,
    mps=MPS,
)
MPS_CONFIG = {"apiVersion": dra.CONFIG_API_VERSION, "kind": dra.CONFIG_KIND, "mps": True}


def result(
    device: str, memory: str | None = "4Gi", *, request: str = "gpu", pool: str = "n1", compute: str | None = None
) -> dict[str, Any]:
    consumed = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    body: dict[str, Any] = {"request": request, "driver": dra.DRIVER, "pool": pool, "device": device}
    if consumed:
        body["consumedCapacity"] = consumed
    return body


def claim(*results: dict[str, Any], config: list[dict[str, Any]] | None = None, uid: str = "uid-1") -> dict[str, Any]:
    devices: dict[str, Any] = {"results": list(results)}
    if config is not None:
        devices["config"] = config
    return {
        "metadata": {"namespace": "team", "name": "train", "uid": uid},
        "status": {"allocation": {"devices": devices}},
    }


def opaque(
    parameters: dict[str, Any], *, requests: list[str] | None = None, source: str = "FromClaim"
) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": dra.DRIVER, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def prepared(
    *devices: tuple[str, str], uid: str = "other", mps: bool = False, compute: str | None = None
) -> PreparedClaim:
    body = claim(
        *(result(d, m, compute=compute) for d, m in devices), uid=uid, config=[opaque(MPS_CONFIG)] if mps else None
    )
    outcome = decide(ClaimRef("team", uid, uid), body, NODE)
    assert isinstance(outcome, PreparedClaim), outcome
    return outcome


def with_prepared(*claims: PreparedClaim, node: DraNode = NODE) -> DraNode:
    return DraNode(**{**node.__dict__, "prepared": list(claims)})


@pytest.mark.parametrize(
    ("body", "node", "refusal"),
    [
        pytest.param(claim(result(G0), uid="uid-2"), NODE, "is now another object", id="claim re-created"),
        pytest.param({"metadata": {"uid": "uid-1"}, "status": {}}, NODE, "is the claim allocated", id="not allocated"),
        pytest.param(claim(result(G0, pool="n2")), NODE, "of pool n2, not of node n1", id="another node's device"),
        pytest.param(claim(result("gpu-gone")), NODE, "which node n1 does not have", id="a GPU that is not here"),
        pytest.param(claim(result(G2)), NODE, "which is unhealthy", id="an unhealthy GPU"),
        pytest.param(
            claim(result(G0, "12Gi")), with_prepared(prepared((G0, "4Gi"))), "16 GiB of 15 GiB", id="past memory"
        ),
        pytest.param(
            claim(result(G0)), with_prepared(prepared((G0, None))), "it does not fit", id="beside a whole-GPU claim"
        ),
        pytest.param(
            claim(result(G0, compute="50")),
            with_prepared(prepared((G0, "1Gi"), compute="60")),
            "compute claimed on GPU 0 to 110 percent",
            id="past compute",
        ),
        pytest.param(
            claim(result(G0), config=[opaque(MPS_CONFIG)]),
            DraNode(**{**NODE.__dict__, "mps": None}),
            "runs no MPS daemons",
            id="MPS on a node without",
        ),
        pytest.param(
            claim(result(G1), config=[opaque(MPS_CONFIG)]), NODE, "daemon of GPU 1 is not running", id="no daemon"
        ),
        pytest.param(
            claim(result(G0), result(G1), config=[opaque(MPS_CONFIG)]),
            DraNode(**{**NODE.__dict__, "mps": {**MPS, "GPU-1bbb": MPS["GPU-0aaa"]}}),
            "MPS on GPUs [0, 1]",
            id="MPS on two GPUs",
        ),
        pytest.param(
            claim(result(G0, compute="40"), config=[opaque({**MPS_CONFIG, "computeLimit": 30})]),
            NODE,
            "computeLimit 30 is below the 40 percent",
            id="limit below the claimed compute",
        ),
        pytest.param(
            claim(result(G0), config=[opaque({**MPS_CONFIG, "mps": "yes"})]),
            NODE,
            "expected true or false",
            id="bad config",
        ),
        pytest.param(
            claim(result(G0), config=[opaque({**MPS_CONFIG, "memoryLimit": 1})]),
            NODE,
            "unknown fields",
            id="unknown field",
        ),
        pytest.param(claim(result(G0, "-1")), NODE, "must not be negative", id="negative memory"),
        pytest.param(claim(result(G0, "0")), NODE, "at least one", id="memory 0: below the request policy"),
        pytest.param(claim(result(G0, "1536Mi")), NODE, "whole units of 1073741824 bytes", id="not whole units"),
        pytest.param(claim(result(G0, "1.5")), NODE, "whole numbers", id="a fraction of a byte"),
        pytest.param(
            claim(result(G1)),
            DraNode(**{**NODE.__dict__, "present_devices": ("/dev/nvidiactl",)}),
            "does not exist",
            id="no file",
        ),
    ],
)
def test_refusals(body: dict[str, Any], node: DraNode, refusal: str) -> None:
    outcome = decide(REF, body, node)
    assert isinstance(outcome, PrepareRefusal), outcome
    assert refusal in outcome.message
    assert "team/train" in outcome.message


def test_a_fractional_claim_gets_its_gpu_by_device_file_and_variable() -> None:
    outcome = decide(REF, claim(result(G1, "4Gi")), NODE)
    assert isinstance(outcome, PreparedClaim)
    (device,) = outcome.devices
    assert (device.index, device.memory, device.memory_mib, device.mps) == (1, 4, 4096, False)
    assert device.cdi_device_ids == ("gpushared.io/claim=uid-1-gpu",)
    spec = cdi_spec(outcome)
    assert spec["kind"] == "gpushared.io/claim"
    (cdi,) = spec["devices"]
    assert cdi["name"] == "uid-1-gpu"
    assert cdi["containerEdits"]["env"] == [
        "ALIYUN_COM_GPU_MEM_CONTAINER=4",
        "ALIYUN_COM_GPU_MEM_DEV=15",
        "ALIYUN_COM_GPU_MEM_IDX=1",
        "GPUSHARED_CLAIM_UID1_GPU=GPU-1bbb",  # the claim's own: no other CDI device sets it
        "NVIDIA_VISIBLE_DEVICES=GPU-1bbb",
    ]
    assert cdi["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia1", "hostPath": "/dev/nvidia1", "permissions": "rw"},
        {"path": "/dev/nvidiactl", "hostPath": "/dev/nvidiactl", "permissions": "rw"},
    ]


def test_an_mps_claim_is_a_client_held_to_its_memory_and_compute() -> None:
    body = claim(result(G0, "3Gi", compute="20"), config=[opaque({**MPS_CONFIG, "computeLimit": 50})])
    outcome = decide(REF, body, NODE)
    assert isinstance(outcome, PreparedClaim)
    assert outcome.devices[0].mps_threads == 50
    edits = cdi_spec(outcome)["devices"][0]["containerEdits"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3072M" in edits["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in edits["env"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
    assert {m["containerPath"]: m["hostPath"] for m in edits["mounts"]} == {
        "/tmp/nvidia-mps": "/run/gpushared/mps/GPU-0aaa/pipe",
        "/dev/shm": "/run/gpushared/mps/GPU-0aaa/shm",
    }


@pytest.mark.parametrize(
    ("memory", "compute", "limit", "threads"),
    [
        pytest.param("3Gi", None, None, 20, id="its share of the memory, rounded up"),
        pytest.param("3Gi", "35", None, 35, id="the compute it claimed"),
        pytest.param("3Gi", "35", 70, 70, id="its limit"),
    ],
)
def test_an_mps_claims_thread_percentage(memory: str, compute: str | None, limit: int | None, threads: int) -> None:
    config = {**MPS_CONFIG, **({"computeLimit": limit} if limit is not None else {})}
    outcome = decide(REF, claim(result(G0, memory, compute=compute), config=[opaque(config)]), NODE)
    assert isinstance(outcome, PreparedClaim)
    assert outcome.devices[0].mps_threads == threads


def test_two_gpus_of_one_request_share_one_cdi_device() -> None:
    outcome = decide(REF, claim(result(G0, None), result(G1, None)), NODE)
    assert isinstance(outcome, PreparedClaim)
    assert [d.cdi_device_ids for d in outcome.devices] == [("gpushared.io/claim=uid-1-gpu",), ()]
    assert [d.memory for d in outcome.devices] == [15, 15], "no consumed capacity: the whole GPU"
    (cdi,) = cdi_spec(outcome)["devices"]
    assert "NVIDIA_VISIBLE_DEVICES=GPU-0aaa,GPU-1bbb" in cdi["containerEdits"]["env"]
    assert [d["path"] for d in cdi["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia0",
        "/dev/nvidia1",
        "/dev/nvidiactl",
    ]


def test_toolkit_cdi_names_come_with_each_gpu_under_cdi_cri() -> None:
    node = DraNode(**{**NODE.__dict__, "exposure": ExposurePolicy(strategies=frozenset({Strategy.CDI_CRI}))})
    outcome = decide(REF, claim(result(G0, request="a"), result(G1, request="b")), node)
    assert isinstance(outcome, PreparedClaim)
    assert [d.cdi_device_ids for d in outcome.devices] == [
        ("gpushared.io/claim=uid-1-a", "nvidia.com/gpu=GPU-0aaa"),
        ("gpushared.io/claim=uid-1-b", "nvidia.com/gpu=GPU-1bbb"),
    ]


def test_the_claims_own_configuration_wins_over_the_class_and_names_its_requests() -> None:
    body = claim(
        result(G0, request="a"),
        result(G1, request="b"),
        config=[
            opaque({**MPS_CONFIG, "computeLimit": 40}, requests=["a"]),
            opaque({**MPS_CONFIG, "mps": False}, source="FromClass"),
            {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"anything": 1}}},
        ],
    )
    configs = {d.request: d.config for d in allocated_devices(body)}
    assert configs == {"a": dra.GpuConfig(mps=True, compute_limit=40), "b": dra.GpuConfig(mps=False)}


def test_devices_of_other_drivers_are_someone_elses() -> None:
    body = claim(result(G0), {"request": "nic", "driver": "net.example.com", "pool": "n1", "device": "eth1"})
    outcome = decide(REF, body, NODE)
    assert isinstance(outcome, PreparedClaim)
    assert [d.device for d in outcome.devices] == [G0]


def test_the_same_claim_prepared_again_is_counted_once() -> None:
    first = decide(REF, claim(result(G0, "12Gi")), NODE)
    assert isinstance(first, PreparedClaim)
    again = decide(REF, claim(result(G0, "12Gi")), with_prepared(first))
    assert again == first


def test_the_checkpoint_holds_everything_a_spec_is_made_of() -> None:
    claims = []
    for ref, body in (
        (REF, claim(result(G0, "3Gi"), config=[opaque(MPS_CONFIG)])),
        (ClaimRef("team", "b", "uid-b"), claim(result(G1, None), uid="uid-b")),
    ):
        outcome = decide(ref, body, NODE)
        assert isinstance(outcome, PreparedClaim)
        claims.append(outcome)
    back = parse_checkpoint(format_checkpoint(claims))
    assert back == sorted(claims, key=lambda c: c.ref)
    assert [cdi_spec(c) for c in back] == [cdi_spec(c) for c in sorted(claims, key=lambda c: c.ref)]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        '{"version": 2, "claims": []}',
        '{"version": 1, "claims": [{"namespace": 1}]}',
        '{"version": 1}',
        "[" * 50_000 + "]" * 50_000,
        '{"version": 1, "claims": ' + "[" * 50_000 + "]" * 50_000 + "}",
        '{"version": 1, "claims": [{"namespace": "n", "name": "c", "uid": "../../../../tmp/x", '
        '"devices": [], "cdi": []}]}',
        '{"version": 1, "claims": [{"namespace": "n", "name": "c", "uid": "u", "devices": [], '
        '"cdi": [{"name": "x", "env": ["A=1"], "deviceNodes": [], "mounts": []}]}]}',
        '{"version": 1, "claims": {"a": 1}}',
    ],
    ids=[
        "empty",
        "list",
        "version 2",
        "namespace 1",
        "no claims",
        "nested",
        "nested claims",
        "UID a path",
        "env a list",
        "claims an object",
    ],
)
def test_a_checkpoint_that_does_not_parse_is_an_error_not_a_crash(text: str) -> None:
    with pytest.raises(ContractError):
        parse_checkpoint(text)


# --- what a DRA pod's containers may use (core.dra.allowances.claim_allowances) -------------------------------------


def dra_pod(
    *containers: dict[str, Any], claims: list[dict[str, Any]], statuses: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "team", "uid": "pod-uid"},
        "spec": {"resourceClaims": claims, "containers": list(containers)},
        "status": {},
    }
    if statuses is not None:
        body["status"]["resourceClaimStatuses"] = statuses
    return body


def test_containers_may_use_what_the_claims_they_name_hold() -> None:
    two = decide(REF, claim(result(G0, "3Gi", request="a"), result(G1, "5Gi", request="b")), NODE)
    assert isinstance(two, PreparedClaim)
    book = {("team", "train"): two}
    body = dra_pod(
        {"name": "both", "resources": {"claims": [{"name": "gpus"}]}},
        {"name": "only-b", "resources": {"claims": [{"name": "gpus", "request": "b"}]}},
        {"name": "none"},
        {"name": "elsewhere", "resources": {"claims": [{"name": "other"}]}},
        claims=[{"name": "gpus", "resourceClaimName": "train"}, {"name": "other", "resourceClaimName": "unprepared"}],
    )
    found = claim_allowances(body, book, node=Enforcement.REPORT)
    # request b's 5 GiB is shared by the two containers that use it (issue #52, item 8: each was held to all
    # of it, 10 GiB between them); request a's 3 GiB is "both"'s alone
    assert found == {
        ("pod-uid", "both"): Allowance({0: 3072, 1: 2560}, Enforcement.REPORT),
        ("pod-uid", "only-b"): Allowance({1: 2560}, Enforcement.REPORT),
    }


def test_the_containers_of_one_claim_share_its_memory_in_their_limits() -> None:
    """Issue #52, item 8: two containers of one 2 GiB MPS claim each got ALIYUN_COM_GPU_MEM_CONTAINER=2 and
    an MPS cap of 2 GiB, so together they could use twice what was allocated."""
    body = dra_pod(
        {"name": "app", "resources": {"claims": [{"name": "gpu"}]}},
        {"name": "helper", "resources": {"claims": [{"name": "gpu"}]}},
        claims=[{"name": "gpu", "resourceClaimName": "train"}],
    )
    body["spec"]["initContainers"] = [
        {"name": "setup", "resources": {"claims": [{"name": "gpu"}]}},  # runs before them, alone: not counted
        {"name": "proxy", "restartPolicy": "Always", "resources": {"claims": [{"name": "gpu"}]}},  # a sidecar
    ]
    users = claim_users([body])
    assert users == {("team", "train", None): 3}
    prepared_claim = decide(REF, claim(result(G0, "6Gi"), config=[opaque(MPS_CONFIG)]), NODE, users=users)
    assert isinstance(prepared_claim, PreparedClaim)
    (device,) = prepared_claim.devices
    (cdi,) = prepared_claim.cdi
    assert device.sharers == 3 and device.memory == 6
    assert cdi.env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
    assert cdi.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert parse_checkpoint(format_checkpoint([prepared_claim])) == [prepared_claim]
    parts = claim_allowances(body, {("team", "train"): prepared_claim}, node=Enforcement.KILL)
    assert {k[1]: a.allocated_mib for k, a in parts.items()} == {
        n: {0: 2048} for n in ("setup", "proxy", "app", "helper")
    }
    # a second pod joins the claim later (the kubelet prepares it once): the parts shrink in the watcher
    other = {**body, "metadata": {"name": "q", "namespace": "team", "uid": "q-uid"}}
    later = claim_allowances(
        body, {("team", "train"): prepared_claim}, node=Enforcement.KILL, users=claim_users([body, other])
    )
    assert later[("pod-uid", "app")].allocated_mib == {0: 1024}
    # a request's part must leave each container something
    thin = decide(REF, claim(result(G0, "1Gi")), NODE, users=Counter({("team", "train", None): 2000}))
    assert isinstance(thin, PrepareRefusal) and "shared by 2000 containers" in thin.message


def test_a_claim_made_from_a_template_is_found_by_the_name_the_pod_status_gives() -> None:
    mps = decide(
        ClaimRef("team", "p-gpu-x7k2", "uid-m"),
        claim(result(G0, "2Gi"), config=[opaque(MPS_CONFIG)], uid="uid-m"),
        NODE,
    )
    assert isinstance(mps, PreparedClaim)
    body = dra_pod(
        {"name": "app", "resources": {"claims": [{"name": "gpu"}]}},
        claims=[{"name": "gpu", "resourceClaimTemplateName": "gpu-2gi"}],
        statuses=[{"name": "gpu", "resourceClaimName": "p-gpu-x7k2"}],
    )
    assert claim_allowances(body, {("team", "p-gpu-x7k2"): mps}, node=Enforcement.KILL) == {
        ("pod-uid", "app"): Allowance({0: 2048}, Enforcement.KILL, mps=True)
    }
    assert claim_allowances(body, {("elsewhere", "p-gpu-x7k2"): mps}, node=Enforcement.KILL) == {}
