"""The fake libnvidia-ml.so.1 under the real pynvml: what our NVML adapter will see on a GPU node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from gpushared.core.shared.topology import Topology
from gpushared.nvml.backend import NvmlBackend
from tests.fakes.nvml import FakeNvml
from tests.fakes.topologies import LAYOUTS, layout


@pytest.fixture
def nvml(fake_nvml: FakeNvml) -> Iterator[FakeNvml]:
    pynvml.nvmlInit()
    yield fake_nvml
    pynvml.nvmlShutdown()


def test_count_memory_uuids_and_names(nvml: FakeNvml) -> None:
    assert pynvml.nvmlDeviceGetCount() == 4
    seen = []
    for i in range(4):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        seen.append((pynvml.nvmlDeviceGetUUID(handle), memory.total // 2**20, memory.free // 2**20))
        assert pynvml.nvmlDeviceGetIndex(handle) == i
        assert pynvml.nvmlDeviceGetMinorNumber(handle) == i
        assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA Fake GPU"
    assert seen == [(gpu.uuid, gpu.memory_mib, gpu.memory_mib) for gpu in nvml.gpus]
    assert len({uuid for uuid, _, _ in seen}) == 4
    assert all(uuid.startswith("GPU-") for uuid, _, _ in seen)
    assert pynvml.nvmlSystemGetDriverVersion() == "535.261.03"


def test_lookup_by_uuid_and_versioned_memory_info(nvml: FakeNvml) -> None:
    handle = pynvml.nvmlDeviceGetHandleByUUID(nvml.gpus[2].uuid)
    assert pynvml.nvmlDeviceGetIndex(handle) == 2
    info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert info.total == 24576 * 2**20
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-missing")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(4)


def test_state_changes_are_seen_by_a_running_process(nvml: FakeNvml) -> None:
    nvml.gpus[0].used_mib = 1000
    nvml.gpus[0].processes = [(4242, 1000)]
    nvml.gpus[1].mig_mode = 1
    nvml.gpus.append(nvml.gpus[3].__class__(uuid="GPU-hotplug", memory_mib=40960))
    nvml.write()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).used == 1000 * 2**20
    processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert [(p.pid, p.usedGpuMemory) for p in processes] == [(4242, 1000 * 2**20)]
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(2)) == []
    assert pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(1)) == [1, 1]
    assert pynvml.nvmlDeviceGetCount() == 5


def test_injected_errors_surface_as_pynvml_exceptions(nvml: FakeNvml) -> None:
    nvml.gpus[1].errors = {"nvmlDeviceGetMemoryInfo": "GPU_IS_LOST"}
    nvml.write()
    with pytest.raises(pynvml.nvmlExceptionClass(pynvml.NVML_ERROR_GPU_IS_LOST)):
        pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1))
    assert pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total > 0
    nvml.errors = {"nvmlDeviceGetCount_v2": "UNKNOWN"}
    nvml.write()
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetCount()


def test_init_failure_as_on_a_node_without_a_driver(fake_nvml: FakeNvml) -> None:
    fake_nvml.errors = {"nvmlInitWithFlags": "DRIVER_NOT_LOADED"}
    fake_nvml.write()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()


def test_xid_event_reaches_a_waiting_event_set(nvml: FakeNvml) -> None:
    nvml.xid(0, 13)  # before registration: never replayed
    events = pynvml.nvmlEventSetCreate()
    for i in (1, 2):
        pynvml.nvmlDeviceRegisterEvents(
            pynvml.nvmlDeviceGetHandleByIndex(i), pynvml.nvmlEventTypeXidCriticalError, events
        )
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(events, 50)
    nvml.xid(0, 48)  # GPU 0 is not registered in this set
    nvml.xid(2, 79)
    data = pynvml.nvmlEventSetWait(events, 5000)  # delivered: a wait that found nothing would time out
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError
    assert data.eventData == 79
    assert pynvml.nvmlDeviceGetUUID(data.device) == nvml.gpus[2].uuid
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(events, 50)
    pynvml.nvmlEventSetFree(events)


def test_a_subprocess_finds_the_fake_through_its_environment(fake_nvml: FakeNvml) -> None:
    script = (
        "import json, pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(3);"
        "print(json.dumps([pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetUUID(h),"
        " pynvml.nvmlDeviceGetMemoryInfo(h).total]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == [4, fake_nvml.gpus[3].uuid, 8192 * 2**20]


def test_a_half_written_config_keeps_the_last_good_state(nvml: FakeNvml) -> None:
    assert pynvml.nvmlDeviceGetCount() == 4
    nvml.config_path.write_text('{"devices": [')
    assert pynvml.nvmlDeviceGetCount() == 4


def test_the_backend_reads_compute_and_graphics_processes_live(nvml: FakeNvml) -> None:
    from gpushared.nvml.backend import GpuBackendError, NvmlBackend, NvmlProcess

    backend = NvmlBackend()
    uuid = nvml.gpus[1].uuid
    assert backend.processes(uuid) == []
    nvml.set_processes(1, (300, 2048), (200, 64, "graphics"), (300, 16, "graphics"), (400, -1))
    assert backend.processes(uuid) == [
        NvmlProcess(pid=200, used_mib=64, graphics=True),
        NvmlProcess(pid=300, used_mib=2048),  # listed once, with its larger amount
        NvmlProcess(pid=400, used_mib=None),  # the driver cannot say
    ]
    nvml.set_processes(1, (300, 5120))
    assert backend.processes(uuid) == [NvmlProcess(pid=300, used_mib=5120)]
    nvml.gpus[1].errors = {"nvmlDeviceGetComputeRunningProcesses_v3": "GPU_IS_LOST"}
    nvml.write()
    with pytest.raises(GpuBackendError, match=r"reading the processes of .*GPU is lost"):
        backend.processes(uuid)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_backend_reads_each_layout_as_nvidia_smi_prints_it(nvml: FakeNvml, name: str) -> None:
    """Links from NVLink state and far ends (to peers on a DGX-1, to NVSwitches on a DGX A100), else the PCIe
    common ancestor; NUMA nodes from NVML; an older driver's NOT_SUPPORTED as unknown, not as an error."""
    expected = layout(name)
    nvml.gpus = FakeNvml.with_layout(nvml.config_path, nvml.library, name).gpus
    nvml.set_layout(expected)
    backend = NvmlBackend()
    gpus, failed = backend.devices()
    assert not failed and [gpu.numa for gpu in gpus] == [expected.numa[i] for i in range(len(gpus))]
    assert gpus[1].pci_bus_id == "00000000:11:00.0"
    read = Topology(links=backend.links(gpus))
    indices = [gpu.index for gpu in gpus]
    assert read.matrix(indices) == expected.matrix(indices)
    if name == "dgx-a100":
        assert nvml.nvswitch_buses and all(bus in nvml.nvswitch_buses for bus in nvml.gpus[0].nvlinks)


def test_nvlink_far_ends_that_are_no_gpu_of_the_set_join_no_pair(nvml: FakeNvml) -> None:
    """A link whose far end is neither a GPU of the node nor a switch (an IBM NPU, a GPU NVML hides) joins no
    pair, and GPUs not asked about are no far end either."""
    nvml.gpus = FakeNvml.with_layout(nvml.config_path, nvml.library, "dgx1").gpus
    nvml.set_layout(layout("dgx1"))
    nvml.gpus[0].nvlinks.append(0xEE)  # a bus nothing is on
    nvml.write()
    backend = NvmlBackend()
    gpus, _ = backend.devices()
    assert str(Topology(links=backend.links(gpus)).link(0, 3)) == "NV2"
    assert str(Topology(links=backend.links(gpus[:3])).link(0, 1)) == "NV1"  # GPU 3 not asked about


def test_gpu_check_compares_the_daemons_matrix_with_nvidia_smis(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    """scripts/gpu-check --topology on the fake NVML wired as a DGX-1, beside an ``nvidia-smi`` that prints
    the DGX-1's matrix as nvidia-smi 535 lays it out; then one that disagrees on a pair."""
    if os.geteuid() != 0:
        pytest.skip("gpu-check runs as root")
    fake_nvml.gpus = FakeNvml.with_layout(fake_nvml.config_path, fake_nvml.library, "dgx1").gpus
    fake_nvml.set_layout(layout("dgx1"))
    matrix = layout("dgx1").matrix(list(range(8)))

    def printed(rows: list[list[str]]) -> str:
        head = "\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        body = "".join(
            f"GPU{i}\t" + "\t".join(" X " if c == "X" else c for c in row) + f"\t0-7\t{i // 4}\t\tN/A\n"
            for i, row in enumerate(rows)
        )
        return head + body + "\nLegend:\n\n  X    = Self\n"

    def run(rows: list[list[str]]) -> dict[str, object]:
        tool = tmp_path / "bin" / "nvidia-smi"
        tool.parent.mkdir(exist_ok=True)
        (tmp_path / "topo.txt").write_text(printed(rows))
        tool.write_text(f"#!/bin/sh\ncat {tmp_path / 'topo.txt'}\n")
        tool.chmod(0o755)
        env = {
            **os.environ,
            **fake_nvml.env(),
            "PATH": f"{tool.parent}:{os.environ['PATH']}",
            "GPU_CHECK_RESULTS": str(tool.parent / "results"),
        }
        script = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"
        done = subprocess.run(
            [sys.executable, str(script), "--topology"], capture_output=True, text=True, env=env, check=False
        )
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    agreed = run(matrix)
    assert agreed["verdict"] == "matrices agree" and agreed["pairs"] == 28, agreed
    wrong = [list(row) for row in matrix]
    wrong[0][1] = wrong[1][0] = "NV2"
    differ = run(wrong)
    assert differ["verdict"] == "matrices differ"
    assert differ["differ"] == [{"pair": [0, 1], "gpushared": "NV1", "nvidia-smi": "NV2"}]
