"""The node daemon as a process: registration with the kubelet, GPU health, the inventory, and how it starts."""

from __future__ import annotations

import json
import time

from gpushared import contract
from tests.harness import GPU_MEM, NODE, TOTAL_UNITS, Daemon, started, wait_until


def test_registers_advertises_per_gpu_sizes_and_publishes_the_inventory(daemon: Daemon) -> None:
    started(daemon)
    registration = daemon.kubelet.registrations[-1]
    assert (registration.version, registration.resource_name) == ("v1beta1", GPU_MEM)
    assert registration.options.get_preferred_allocation_available
    devices = daemon.kubelet.devices(GPU_MEM)
    assert sum(1 for d in devices if d.startswith("2-")) == 24  # each GPU its own size
    assert max(len(d) for d in devices) <= 5
    inventory = daemon.inventory()
    assert inventory.unit is contract.MemoryUnit.GIB
    assert [(g.index, g.uuid, g.memory, g.memory_mib, g.healthy) for g in inventory.gpus] == [
        (i, gpu.uuid, gpu.memory_mib // 1024, gpu.memory_mib, True) for i, gpu in enumerate(daemon.nvml.gpus)
    ]
    node = daemon.api.get("nodes", NODE)
    assert node["status"]["capacity"]["aliyun.com/gpu-count"] == "4"  # type: ignore[index]
    socket = daemon.kubelet.plugin_dir / "gpushared.sock"
    assert socket.stat().st_mode & 0o777 == 0o600
    daemon.notify.wait_for("STATUS=serving 4 GPUs, 60 GiB")


def test_registers_again_after_a_kubelet_restart(daemon: Daemon) -> None:
    started(daemon)
    daemon.kubelet.restart()
    assert daemon.kubelet.capacity(GPU_MEM) == 0
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS)
    assert len(daemon.kubelet.registrations) == 2


def test_registers_again_when_its_socket_is_deleted(daemon: Daemon) -> None:
    started(daemon)
    (daemon.kubelet.plugin_dir / "gpushared.sock").unlink()
    wait_until(lambda: len(daemon.kubelet.registrations) == 2, message="re-registration")
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS)


def test_xid_withdraws_a_gpu_and_it_recovers_after_the_quiet_period(daemon: Daemon) -> None:
    started(daemon)
    before = daemon.kubelet.endpoints[GPU_MEM].updates
    daemon.nvml.xid(1, 13)  # an application error: ignored
    wait_until(lambda: "XID 13 (an application's error) on" in daemon.log(), message="the event judged")
    daemon.turns()
    assert daemon.kubelet.capacity(GPU_MEM) == TOTAL_UNITS
    daemon.nvml.xid(1, 79)  # fallen off the bus
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS - 12)
    assert daemon.kubelet.endpoints[GPU_MEM].updates > before
    assert daemon.kubelet.devices(GPU_MEM)["1-0"] == "Unhealthy"
    wait_until(lambda: not daemon.inventory().gpus[1].healthy, message="inventory marks GPU 1")
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS, timeout=10)  # recoverAfterSeconds: 2
    wait_until(lambda: daemon.inventory().gpus[1].healthy, message="inventory recovers GPU 1")


def test_nvml_failing_marks_every_gpu_unhealthy_instead_of_crashing(daemon: Daemon) -> None:
    started(daemon)
    daemon.nvml.errors = {"nvmlDeviceGetCount_v2": "GPU_IS_LOST"}
    daemon.nvml.write()
    daemon.kubelet.wait_for(GPU_MEM, capacity=0)
    assert daemon.process is not None and daemon.process.poll() is None
    daemon.nvml.errors = {}
    daemon.nvml.write()
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS, timeout=10)


def test_nvml_failing_on_one_gpu_withdraws_that_gpu_alone(daemon: Daemon) -> None:
    """Defect: GPU_IS_LOST on GPU 2's memory info took the node's capacity from 60 to 0."""
    started(daemon)
    daemon.nvml.gpus[2].errors = {"nvmlDeviceGetMemoryInfo": "GPU_IS_LOST"}
    daemon.nvml.write()
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS - 24)
    wait_until(lambda: [g.healthy for g in daemon.inventory().gpus] == [True, True, False, True], message="GPU 2")
    assert 0 not in daemon.kubelet.capacities(GPU_MEM)  # never 0 on the way
    assert "NVML failed on this GPU" in json.dumps(daemon.status())
    daemon.nvml.gpus[2].errors = {}
    daemon.nvml.write()
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS, timeout=10)  # recoverAfterSeconds: 2


def test_a_foreign_edit_of_the_inventory_is_undone_within_seconds(daemon: Daemon) -> None:
    """Defect (issue #39): GPU 3 inflated from 8 to 80 GiB in the node's inventory annotation lasted until the
    daemon's own next change (30 s and more); the extender bound a 40 GiB pod there that Allocate refused."""
    from kubernetes import client

    started(daemon)
    ours = daemon.inventory_annotations()[contract.NODE_INVENTORY]
    inflated = json.loads(ours)
    inflated["gpus"][3]["memory"], inflated["gpus"][3]["memoryMiB"] = 80, 80 * 1024
    forged = json.dumps(inflated)
    core = client.CoreV1Api(daemon.api.client())
    core.patch_node(NODE, {"metadata": {"annotations": {contract.NODE_INVENTORY: forged}}})
    assert daemon.inventory_annotations()[contract.NODE_INVENTORY] == forged
    started_at = time.monotonic()
    wait_until(lambda: daemon.inventory_annotations()[contract.NODE_INVENTORY] == ours, timeout=5, message="restored")
    assert time.monotonic() - started_at < 5
    assert daemon.inventory().gpus[3].memory == 8
    assert "gpushared_inventory_restored_total 1.0" in daemon.metrics_text()


def test_a_missing_node_stops_the_daemon_with_the_reason(daemon: Daemon) -> None:
    daemon.write_config(nodeName="no-such-node")
    daemon.start()
    assert daemon.wait_exit() == 2
    assert "node 'no-such-node' does not exist in the cluster" in daemon.log()


def test_a_node_without_a_kubeconfig_yet_is_ready_and_serves_once_one_is_written(daemon: Daemon) -> None:
    """The order a node is set up in — package (postinst starts the unit), then kubeconfig — needs no restart."""
    daemon.write_config()
    kubeconfig = daemon.workdir / "kubeconfig"
    written = kubeconfig.read_text()
    kubeconfig.unlink()
    daemon.start()
    daemon.notify.wait_for("READY=1")
    wait_until(lambda: "no kubeconfig at" in daemon.status()["state"], message="status names the missing file")
    daemon.turns(5)
    assert daemon.process is not None and daemon.process.poll() is None
    assert daemon.kubelet.registrations == []  # nothing to look pods up with: not offered to the kubelet yet
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")  # one `kubectl config` step in
    wait_until(lambda: "waiting for a kubeconfig that works" in daemon.status()["state"], message="half-written")
    time.sleep(0.1)  # a later mtime than the half-written file's
    kubeconfig.write_text(written)
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS)
    wait_until(lambda: daemon.status()["state"] == "serving 4 GPUs, 60 GiB", message="serving")


def test_a_node_without_gpus_is_ready_and_waits(daemon: Daemon) -> None:
    """No driver at all (a GPU node before its driver is installed): no crash loop, a clear status."""
    daemon.extra_env["LD_LIBRARY_PATH"] = str(daemon.workdir)  # no libnvidia-ml.so.1 to find
    daemon.start()
    daemon.notify.wait_for("READY=1")
    daemon.notify.wait_for("STATUS=no GPUs: NVML unavailable; waiting")
    wait_until(lambda: daemon.kubelet.registrations, message="registered, with no devices")
    assert daemon.kubelet.capacity(GPU_MEM) == 0
    daemon.turns(5)
    assert daemon.process is not None and daemon.process.poll() is None
    assert daemon.status()["gpus"] == []
    assert daemon.log().count("GPUs unreadable") == 1  # said once, not on every tick


def test_a_bad_config_names_the_key(daemon: Daemon) -> None:
    daemon.write_config(memoryUnit="GB")
    daemon.start()
    assert daemon.wait_exit() != 0
    assert "memoryUnit: must be GiB or MiB (got 'GB')" in daemon.log()


def test_mig_gpus_are_refused_with_a_clear_message(daemon: Daemon) -> None:
    daemon.nvml.gpus[3].mig_mode = 1
    daemon.nvml.write()
    daemon.start()
    daemon.kubelet.wait_for(GPU_MEM, capacity=TOTAL_UNITS - 8)
    wait_until(lambda: "GPU 3" in daemon.log() and "MIG enabled" in daemon.log(), message="MIG message")


def test_mib_devices_too_many_for_the_kubelet_are_refused_at_start(daemon: Daemon) -> None:
    daemon.nvml.gpus = [daemon.nvml.gpus[0].__class__(uuid=f"GPU-big-{i}", memory_mib=81920) for i in range(8)]
    daemon.nvml.write()
    daemon.write_config(memoryUnit="MiB")
    daemon.start()
    assert daemon.wait_exit() == 2
    assert "over the kubelet's 4 MiB limit: set memoryUnit: GiB" in daemon.log()
