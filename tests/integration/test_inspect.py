"""``kubectl inspect gpushare`` against the API server: Aliyun's table, details, JSON, a node argument."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpushared import contract
from gpushared.contract import dra
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.placement.mixbook import MAX_EXPECTED_KINDS
from gpushared.core.shared.requests import pod_request
from tests.builders import inventory, on_gpus, pod
from tests.extender_harness import gpu_node, gpushared_cluster
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.topologies import layout_inventory


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        gpushared_cluster(server)
        ours = pod("train", 6, namespace="ml", node="n1")
        ours["metadata"]["annotations"] = bind_annotations(
            pod_request(ours), [inventory(16, 8).gpus[1]], unit=contract.MemoryUnit.GIB, now_ns=1
        )
        server.create(ours)
        server.create(
            pod(
                "legacy", 4, node="n1", annotations={contract.ALIYUN_GPU_MEM_IDX: "0", contract.ALIYUN_GPU_MEM_POD: "4"}
            )
        )
        server.create(pod("bypass", 2, node="n1"))
        finished = pod(
            "done",
            8,
            node="aliyun-node",
            annotations={contract.ALIYUN_GPU_MEM_IDX: "1", contract.ALIYUN_GPU_MEM_POD: "8"},
        )
        finished["status"]["phase"] = "Succeeded"
        server.create(finished)
        yield server


def inspect(
    api: FakeApiServer,
    tmp_path: Path,
    *args: str,
    command: tuple[str, ...] = (sys.executable, "-m", "gpushared.cli.inspect"),
) -> subprocess.CompletedProcess[str]:
    kubeconfig = tmp_path / "config"
    body = api.kubeconfig()
    body["contexts"].append({"name": "other", "context": {"cluster": "fake", "user": "fake"}})
    kubeconfig.write_text(yaml.safe_dump(body))
    return subprocess.run(
        [*command, *args],
        env={"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_summary_table_in_aliyuns_layout(api: FakeApiServer, tmp_path: Path) -> None:
    result = inspect(api, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "NAME         IPADDRESS  GPU0(Allocated/Total)  GPU1(Allocated/Total)  PENDING(Allocated)  GPU Memory(GiB)",
        "aliyun-node             0/8                    0/8                    0                   0/16",
        "n1           10.0.0.1   4/16                   6/8                    2                   12/24",
        "-" * 105,
        "Allocated/Total GPU Memory In Cluster:",
        "12/40 (30%)",
    ]


def test_details_for_one_node_with_another_context(api: FakeApiServer, tmp_path: Path) -> None:
    result = inspect(api, tmp_path, "-d", "n1", "--context", "other")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "NAME:       n1",
        "IPADDRESS:  10.0.0.1",
        "",
        "NAME    NAMESPACE  GPU0(Allocated)  GPU1(Allocated)  Pending(Allocated)",
        "bypass  default    0                0                2",
        "legacy  default    4                0                0",
        "train   ml         0                6                0",
        "Allocated :  12 (50%)",
        "Total :      24 (GiB)",
        "-" * 60,
        "",
        "",
        "Allocated/Total GPU Memory In Cluster:  12/24 (50%)",
    ]


def test_json_output(api: FakeApiServer, tmp_path: Path) -> None:
    result = inspect(api, tmp_path, "-o", "json")
    body = json.loads(result.stdout)
    n1 = next(n for n in body["nodes"] if n["name"] == "n1")
    assert [(d["id"], d["usedGPU"], [p["name"] for p in d["pods"]]) for d in n1["devs"]] == [
        (0, 4, ["legacy"]),
        (1, 6, ["train"]),
    ]
    assert n1["pending"] == [{"name": "bypass", "namespace": "default", "usedGPU": 2, "problem": None}]


def test_errors_are_clear(api: FakeApiServer, tmp_path: Path) -> None:
    result = inspect(api, tmp_path, "cpu-node")
    assert result.returncode == 1
    assert "node cpu-node is not a gpushared node" in result.stderr
    result = inspect(api, tmp_path, "--context", "nope")
    assert result.returncode == 1
    assert "nope" in result.stderr


def test_details_show_the_link_matrix_and_how_each_multi_gpu_pod_is_linked(api: FakeApiServer, tmp_path: Path) -> None:
    """A DGX-1 node: its links as ``nvidia-smi topo -m`` prints them, and the pairs of a pod on four GPUs."""
    dgx = layout_inventory("dgx1")
    api.create(gpu_node("dgx", inv=dgx, address="10.0.0.9"))
    quad = pod("allreduce", 32, namespace="ml", node="dgx")
    on_gpus(quad, 4)
    quad["metadata"]["annotations"] = bind_annotations(
        pod_request(quad), [dgx.gpus[i] for i in (0, 1, 2, 3)], unit=contract.MemoryUnit.GIB, now_ns=1
    )
    api.create(quad)
    result = inspect(api, tmp_path, "-d", "dgx")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("GPU links:")
    assert lines[start + 1 : start + 3] == [
        "      GPU0  GPU1  GPU2  GPU3  GPU4  GPU5  GPU6  GPU7  NUMA",
        "GPU0  X     NV1   NV1   NV2   NV2   SYS   SYS   SYS   0",
    ]
    assert lines[start + 9] == "GPU7  SYS   SYS   SYS   NV1   NV2   NV1   NV2   X     1"
    assert lines[start + 10].startswith("NV#: # NVLink links")
    assert "ml/allreduce on GPUs 0,1,2,3: 0-1 NV1, 0-2 NV1, 0-3 NV2, 1-2 NV2, 1-3 NV1, 2-3 NV2" in lines
    body = json.loads(inspect(api, tmp_path, "-o", "json", "dgx").stdout)
    assert body["nodes"][0]["links"][0] == ["X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"]
    assert [d["numa"] for d in body["nodes"][0]["devs"]] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_details_of_a_node_without_links_show_no_matrix(api: FakeApiServer, tmp_path: Path) -> None:
    assert "GPU links:" not in inspect(api, tmp_path, "-d").stdout


def test_expected_mix_counts_the_pods_as_the_extender_does_and_the_extender_reads_it(
    api: FakeApiServer, tmp_path: Path
) -> None:
    """Issue #41: the kinds of the pods on gpushared nodes (finished ones not), as the extender's
    ``--expected-mix`` reads them; a file it cannot read stops the extender before it starts, naming the
    entry."""
    pinned = pod("pinned", 6, node="n1", cpu="2")
    pinned["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "A100"}
    api.create(pinned)
    result = inspect(api, tmp_path, "--expected-mix")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document == {
        "weight": 1000.0,
        "kinds": [
            {"cpuMilli": 0, "gpuMem": 2, "gpus": 1, "count": 1},  # bypass: pending, at its spec amount
            {"cpuMilli": 0, "gpuMem": 4, "gpus": 1, "count": 1},
            {"cpuMilli": 0, "gpuMem": 6, "gpus": 1, "count": 1},
            {"cpuMilli": 2000, "gpuMem": 6, "gpus": 1, "models": ["A100"], "count": 1},
        ],
    }
    assert inspect(api, tmp_path, "--expected-mix", "n1").returncode == 2  # the whole cluster or nothing

    command = [sys.executable, "-m", "gpushared.cli.extender", "--expected-mix", str(tmp_path / "mix.json")]
    document["kinds"][1]["gpus"] = "1"
    (tmp_path / "mix.json").write_text(json.dumps(document))
    refused = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "kinds[1].gpus: expected an integer" in refused.stderr, refused.stderr
    (tmp_path / "mix.json").write_text("{")
    refused = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "mix.json" in refused.stderr, refused.stderr
    # Issue #52, item 2: more kinds than the extender takes, and a FIFO (which once hung the start for ever)
    many = [{"cpuMilli": i, "gpuMem": 1, "gpus": 1, "count": 1} for i in range(MAX_EXPECTED_KINDS + 1)]
    (tmp_path / "mix.json").write_text(json.dumps({"kinds": many}))
    refused = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and f"at most {MAX_EXPECTED_KINDS:,}" in refused.stderr, refused.stderr
    (tmp_path / "mix.json").unlink()
    os.mkfifo(tmp_path / "mix.json")
    refused = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not a regular file" in refused.stderr, refused.stderr
    device = [sys.executable, "-m", "gpushared.cli.extender", "--expected-mix", "/dev/zero"]
    refused = subprocess.run(device, check=False, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not a regular file" in refused.stderr, refused.stderr


@pytest.fixture(scope="module")
def zipapp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scripts/build-inspect's single file (pip fetches click, PyYAML and urllib3 at the .deb's pins)."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [root / "scripts" / "build-inspect"], cwd=root, env={**__import__("os").environ, "PYTHON": sys.executable},
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return root / result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("args", [(), ("-d", "n1"), ("-o", "json"), ("--expected-mix",), ("no-such-node",)], ids=str)
def test_the_single_file_plugin_answers_as_the_installed_one(
    api: FakeApiServer, tmp_path: Path, zipapp: Path, args: tuple[str, ...]
) -> None:
    """dist/kubectl-inspect-gpushare on an interpreter with no site-packages at all (-S: none of orjson,
    click, PyYAML or urllib3 but what the file carries) prints what the installed command prints."""
    installed = inspect(api, tmp_path, *args)
    single = inspect(api, tmp_path, *args, command=(sys.executable, "-I", "-S", str(zipapp)))
    assert (single.returncode, single.stdout, single.stderr) == (
        installed.returncode,
        installed.stdout,
        installed.stderr,
    )
    with zipfile.ZipFile(zipapp) as archive:
        names = archive.namelist()
    assert not [n for n in names if n.endswith((".so", ".pyd"))] and "gpushared/cli/inspect.py" in names
    assert not [n for n in names if n.startswith(("orjson", "gpushared/extender/", "gpushared/daemon/"))]


def test_dra_claims_hold_gpus_beside_the_pods(api: FakeApiServer, tmp_path: Path) -> None:
    """On a cluster that serves DRA, the ResourceClaims allocated on a node's GPUs are shown with what they
    consumed, as resourceclaim/<name>; a claim of another driver or node is not."""
    node = api.get("nodes", "n1")
    assert node is not None
    gpu0 = contract.parse_inventory(node["metadata"]["annotations"][contract.NODE_INVENTORY]).gpus[0]
    results = [
        {
            "request": "gpu",
            "driver": dra.DRIVER,
            "pool": "n1",
            "device": dra.device_name(gpu0.uuid),
            "consumedCapacity": {"memory": "3Gi", "compute": "20"},
        },
        {"request": "nic", "driver": "net.example.com", "pool": "n1", "device": "eth0"},
    ]
    api.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "trainer-gpu", "namespace": "ml"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results}}},
        }
    )
    result = inspect(api, tmp_path, "-d", "n1")
    assert result.returncode == 0, result.stderr
    assert (
        "resourceclaim/trainer-gpu  ml         3                0                0                   20"
        in result.stdout
    )
    assert "Allocated :  15 (62%)" in result.stdout
    api.dra_served = False  # a cluster before 1.34: pods alone, and no complaint
    result = inspect(api, tmp_path, "-d", "n1")
    assert "resourceclaim" not in result.stdout and not result.stderr
