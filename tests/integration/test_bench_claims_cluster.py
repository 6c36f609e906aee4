"""scripts/bench_claims_cluster.py without a cluster: its simulated nodes are what the extender and the API
server take, it reads the controller's grace period as Go writes durations, and without Kubernetes >= 1.34
binaries it says so and starts nothing. The benchmark itself needs the real cluster (root,
GPUSHARED_K8S_CACHE >= 1.34) and is never run here; its figures are in docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gpushared import contract
from gpushared.core.dra.slices import slice_body, slice_devices
from tests.fakes.dra import validate_slice

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_claims_cluster.py"


def script() -> ModuleType:
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))  # where it finds benchkit, as when it runs
    spec = importlib.util.spec_from_file_location("bench_claims_cluster", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_simulated_node_is_what_the_extender_reads_and_its_slice_what_the_api_server_takes() -> None:
    bench = sys.modules[script().SimulatedNodes.__module__]  # benchkit/claims_cluster.py
    inv = bench.node_inventory(7, 8, 16)
    node = bench.node_body("sim-0007", inv, "v1.36.2")
    read = contract.parse_inventory(node["metadata"]["annotations"][contract.NODE_INVENTORY])
    assert [gpu.memory for gpu in read.gpus] == [16] * 8
    assert len({gpu.uuid for gpu in read.gpus}) == 8
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]} == {"Ready": "True"}
    validate_slice(slice_body(node="sim-0007", node_uid="uid", generation=1, devices=slice_devices(inv)))
    lease = bench.lease_body("sim-0007", "uid", 40)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", lease["spec"]["renewTime"])  # MicroTime
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "uid"


def test_the_grace_period_read_as_go_writes_durations() -> None:
    parse = script().parse_duration
    assert [parse(text) for text in ("20s", "50s", "1m0s", "1m30.5s", "500ms")] == [20, 50, 60, 90.5, 0.5]
    with pytest.raises(ValueError, match="not a duration"):
        parse("20")


def test_without_dra_binaries_it_starts_nothing(tmp_path: Path) -> None:
    """An empty cache (no binaries: no version) is refused before any cluster is touched."""
    env = {**os.environ, "GPUSHARED_K8S_CACHE": str(tmp_path), "GPUSHARED_CLUSTER_DIR": str(tmp_path / "state")}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--pods", "1"], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert result.returncode != 0
    assert "DRA needs Kubernetes >= 1.34" in result.stderr
    assert not (tmp_path / "state").exists()
