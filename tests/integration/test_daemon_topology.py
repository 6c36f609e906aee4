"""The daemon on a node whose GPUs are linked (issue #24): it reads the links and NUMA nodes through NVML,
publishes them, sends each device's NUMA node to the kubelet, and steers a container on several GPUs to the
best-linked set the extender's pure function chose.

The fake NVML answers the calls the real driver answers (NVLink state and far ends, PCIe common ancestors,
NUMA nodes), wired as ``tests.fakes.topologies`` lays out real machines.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpushared import contract
from gpushared.core.placement.policies import policy_named
from gpushared.core.placement.pricing import PricingContext
from gpushared.core.shared.ledger import Ledger, holding_from_pod
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.core.shared.topology import LinkKind, set_score, topology_of
from gpushared.core.shared.verdicts import judge
from tests.fakes.nvml import FakeNvml
from tests.fakes.topologies import LAYOUTS, layout
from tests.harness import GPU_MEM, Daemon, wait_until

GIB = 16


def on_layout(daemon: Daemon, name: str) -> Daemon:
    """Start the daemon on GPUs of ``GIB`` GiB linked as layout ``name``."""
    daemon.nvml = FakeNvml.with_layout(daemon.workdir / f"{name}.json", daemon.nvml.library, name, GIB * 1024)
    daemon.start()
    daemon.notify.wait_for("READY=1")
    daemon.kubelet.wait_for(GPU_MEM, capacity=GIB * len(daemon.nvml.gpus))
    wait_until(lambda: contract.NODE_INVENTORY in daemon.inventory_annotations(), message="inventory")
    return daemon


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_inventory_and_the_kubelet_get_the_layout(daemon: Daemon, name: str) -> None:
    """What NVML says of the links comes out in the inventory as ``nvidia-smi topo -m`` prints it, and each
    device the kubelet lists carries its GPU's NUMA node; an older driver (no topology) publishes none."""
    on_layout(daemon, name)
    expected = layout(name)
    inventory = daemon.inventory()
    published = topology_of(inventory)
    gpus = [gpu.index for gpu in inventory.gpus]
    if expected.known:
        assert published.matrix(gpus) == expected.matrix(gpus)
    else:
        assert inventory.links == () and not published.known
    assert {gpu.index: gpu.numa for gpu in inventory.gpus} == expected.numa
    numa = daemon.kubelet.numa(GPU_MEM)
    assert len(numa) == GIB * len(gpus)
    for device, nodes in numa.items():
        node = expected.numa[int(device.split("-")[0])]
        assert nodes == (() if node is None else (node,))


def node_ledger(daemon: Daemon) -> Ledger:
    """The node's accounting as the extender keeps it: the published inventory and the pods bound to it."""
    ledger = Ledger.build(daemon.inventory())
    for body in daemon.api.objects("pods"):
        holding = holding_from_pod(body, unit=ledger.inventory.unit)
        if holding is not None:
            ledger.add(holding)
    return ledger


def place_as_the_extender(daemon: Daemon, name: str, gpus: int, per_gpu: int) -> tuple[dict[str, object], list[int]]:
    """Choose the GPUs as the extender's bind does (the same pure function, on the node's ledger), and
    create the pod annotated for them."""
    ledger = node_ledger(daemon)
    ask = PodRequest(containers=(ContainerRequest("c0", per_gpu * gpus, gpus=gpus),))
    choice = policy_named("binpack").choose(judge(ledger, ask), ask, PricingContext(ledger))
    assert choice is not None
    chosen = [verdict.gpu.index for verdict in choice]
    return daemon.place(name, per_gpu * gpus, gpu=chosen), chosen


def test_pods_on_two_and_four_gpus_get_nvlinked_sets_through_preferred_allocation(daemon: Daemon) -> None:
    """On a DGX-1 with GPU 0 partly taken, a 2-GPU pod and then a 4-GPU pod: each set chosen is the best
    linked of those with room; GetPreferredAllocation offers exactly the devices of that set, the kubelet
    takes them, and Allocate gives the container those GPUs."""
    on_layout(daemon, "dgx1")
    dgx1 = layout("dgx1")
    uuid_index = {gpu.uuid: i for i, gpu in enumerate(daemon.nvml.gpus)}
    daemon.admit(daemon.place("small", 4, gpu=0))
    for name, count in (("pair", 2), ("quad", 4)):
        ledger = node_ledger(daemon)
        room = [gpu.index for gpu in ledger.inventory.gpus if ledger.free(gpu) >= GIB // 2]
        body, chosen = place_as_the_extender(daemon, name, count, GIB // 2)
        assert set_score(chosen, dgx1) == max(set_score(s, dgx1) for s in itertools.combinations(room, count))
        assert all(dgx1.link(a, b).kind is LinkKind.NVLINK for a, b in itertools.combinations(chosen, 2))
        before = len([c for c in daemon.kubelet.calls if c[0] == "GetPreferredAllocation"])
        (allocation,) = daemon.admit(body)
        asked = [c for c in daemon.kubelet.calls if c[0] == "GetPreferredAllocation"]
        assert len(asked) == before + 1
        by_gpu = sorted(int(d.split("-")[0]) for d in allocation.device_ids)
        assert by_gpu == sorted(chosen * (GIB // 2))  # the kubelet took what the daemon preferred
        visible = allocation.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert sorted(uuid_index[uuid] for uuid in visible) == sorted(chosen)


def test_a_one_gpu_pod_is_placed_as_without_links(daemon: Daemon) -> None:
    """Links never move a one-GPU pod: its GPU is the one the policy prices best, whatever the layout."""
    on_layout(daemon, "dgx1")
    body, chosen = place_as_the_extender(daemon, "one", 1, 5)
    assert chosen == [0]  # binpack's tie among empty GPUs: the lowest index
    (allocation,) = daemon.admit(body)
    assert {d.split("-")[0] for d in allocation.device_ids} == {"0"}


def test_a_node_whose_driver_fails_on_links_still_serves(daemon: Daemon, fake_nvml_library: Path) -> None:
    """NVLink calls failing with UNKNOWN on one GPU leave its NVLink pairs to the PCIe answer; the node serves."""
    daemon.nvml = FakeNvml.with_layout(daemon.workdir / "flaky.json", fake_nvml_library, "dgx1", GIB * 1024)
    daemon.nvml.gpus[3].errors = {"nvmlDeviceGetNvLinkState": "UNKNOWN"}
    daemon.nvml.write()
    daemon.start()
    daemon.kubelet.wait_for(GPU_MEM, capacity=GIB * 8)
    wait_until(lambda: contract.NODE_INVENTORY in daemon.inventory_annotations(), message="inventory")
    published = topology_of(daemon.inventory())
    assert str(published.link(0, 1)) == "NV1"
    # GPU 3's own links are unread, but its peers see theirs to it
    assert str(published.link(0, 3)) == "NV2"
    assert str(published.link(3, 7)) == "NV1"


def test_status_prints_the_link_matrix_as_nvidia_smi_does(daemon: Daemon) -> None:
    on_layout(daemon, "pcie-2-socket")
    env = {**daemon.nvml.env(), "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-m", "gpushared.cli.daemon", "status", "--config", str(daemon.config_path)]
    lines = subprocess.run(run, capture_output=True, text=True, check=True, env=env).stdout.splitlines()
    start = lines.index("      GPU0  GPU1  GPU2  GPU3  GPU4  GPU5  NUMA")
    assert lines[start + 1 : start + 7] == [
        "GPU0  X     PIX   PXB   SYS   SYS   SYS   0",
        "GPU1  PIX   X     PXB   SYS   SYS   SYS   0",
        "GPU2  PXB   PXB   X     SYS   SYS   SYS   0",
        "GPU3  SYS   SYS   SYS   X     PIX   NODE  1",
        "GPU4  SYS   SYS   SYS   PIX   X     NODE  1",
        "GPU5  SYS   SYS   SYS   NODE  NODE  X     1",
    ]
    assert lines[start + 7].startswith("NV#: # NVLink links")
    body = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True, env=env).stdout)
    assert body["links"][3][5] == "NODE" and [gpu["numa"] for gpu in body["gpus"]] == [0, 0, 0, 1, 1, 1]
