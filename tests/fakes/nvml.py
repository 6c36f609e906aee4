"""Build and drive the fake ``libnvidia-ml.so.1`` (``fake_nvml.c``) for tests and local clusters.

The library is compiled on first use against the official ``nvml.h`` from the ``nvidia-nvml-dev`` wheel, so
a signature that drifts from NVIDIA's header fails the build rather than a test. The GPUs it shows live in
a JSON file that :class:`FakeNvml` rewrites atomically; the library notices and reloads on its next call.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushared.core.shared.topology import LinkKind, Topology
from tests.fakes import topologies

SOURCE = Path(__file__).with_name("nvml") / "fake_nvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"


def nvml_include_dir() -> Path:
    """Where the nvidia-nvml-dev wheel put ``nvml.h`` (its folder name follows the CUDA major)."""
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        if base.is_dir():
            for header in sorted(base.glob("*/include/nvml.h")):
                return header.parent
    raise FileNotFoundError("nvml.h not found: install the nvidia-nvml-dev wheel (it is in the dev extra)")


def build_library(out_dir: Path) -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1`` unless an up-to-date copy is there."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY_NAME
    if target.exists() and target.stat().st_mtime >= SOURCE.stat().st_mtime:
        return target
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise FileNotFoundError("no C compiler: install gcc")
    scratch = out_dir / f".{LIBRARY_NAME}.{os.getpid()}"
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wno-unused-parameter",
            f"-I{nvml_include_dir()}",
            f"-Wl,-soname,{LIBRARY_NAME}",
            "-o",
            str(scratch),
            str(SOURCE),
            "-lpthread",
        ],
        check=True,
    )
    scratch.replace(target)
    return target


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA Fake GPU"
    memory_mib: int = 16384
    used_mib: int = 0
    minor: int | None = None
    compute_capability: tuple[int, int] = (8, 0)
    mig_mode: int = 0
    #: (pid, used MiB) of compute processes, or (pid, used MiB, "graphics"); used -1: the driver cannot say
    processes: list[tuple[int, int] | tuple[int, int, str]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # NVML function -> error name
    #: PCI bus number (domain 0); None: 0x10 + index
    pci_bus: int | None = None
    #: NUMA node; None: the driver does not say
    numa: int | None = None
    #: the PCI bus at the far end of each active NVLink link (another GPU's, or an NVSwitch's)
    nvlinks: list[int] = field(default_factory=list)
    #: pid -> its SM use, %: what nvmlDeviceGetProcessUtilization samples (a compute process not here has none)
    sm_util: dict[int, int] = field(default_factory=dict)

    def bus(self, index: int) -> int:
        return 0x10 + index if self.pci_bus is None else self.pci_bus

    def to_json(self, index: int) -> dict[str, Any]:
        return {
            "pciBus": self.bus(index),
            **({"numaNode": self.numa} if self.numa is not None else {}),
            "nvlinks": self.nvlinks,
            "uuid": self.uuid,
            "name": self.name,
            "memoryMiB": self.memory_mib,
            "usedMiB": self.used_mib,
            "minor": index if self.minor is None else self.minor,
            "computeCapability": list(self.compute_capability),
            "migMode": self.mig_mode,
            "processes": [
                {
                    "pid": p[0],
                    "usedMiB": p[1],
                    "kind": p[2] if len(p) > 2 else "compute",
                    **({"smUtil": self.sm_util[p[0]]} if p[0] in self.sm_util else {}),
                }
                for p in self.processes
            ],
            "errors": self.errors,
        }


#: NVSwitches sit on PCI buses from here, past the GPUs'; a DGX A100 has six.
SWITCH_BUS = 0xC0
NVSWITCHES = 6

#: nvmlGpuTopologyLevel_t of each PCIe link kind (nvml.h).
_LEVELS = {
    LinkKind.SAME_BOARD: 0,
    LinkKind.SINGLE_SWITCH: 10,
    LinkKind.MULTIPLE_SWITCHES: 20,
    LinkKind.HOST_BRIDGE: 30,
    LinkKind.SAME_CPU: 40,
    LinkKind.CROSS_CPU: 50,
}


def _ancestor(topology: Topology, a: int, b: int) -> int:
    """The PCIe level between two GPUs. A pair joined by NVLink still meets somewhere on PCIe: on one
    socket's host bridge, or across sockets."""
    if a == b:
        return 0
    link = topology.link(a, b)
    if link.kind in _LEVELS:
        return _LEVELS[link.kind]
    same = topology.numa.get(a) is not None and topology.numa.get(a) == topology.numa.get(b)
    return _LEVELS[LinkKind.SAME_CPU if same else LinkKind.CROSS_CPU]


class FakeNvml:
    """The GPUs one fake library shows. Change attributes, then :meth:`write`; or use the helpers."""

    def __init__(self, config_path: Path, library: Path, gpus: list[FakeGpu] | None = None) -> None:
        self.config_path = config_path
        self.library = library
        self.gpus: list[FakeGpu] = list(gpus or [])
        self.errors: dict[str, str] = {}
        self.driver_version = "535.261.03"
        #: PCI buses that are NVSwitches
        self.nvswitch_buses: list[int] = []
        #: nvmlGpuTopologyLevel_t between each two GPUs; None: the driver does not say (NOT_SUPPORTED)
        self.ancestors: list[list[int]] | None = None
        self._events: list[dict[str, Any]] = []
        self.write()

    @classmethod
    def with_sizes(cls, config_path: Path, library: Path, *sizes_mib: int) -> FakeNvml:
        # UUIDs shaped like NVIDIA's, stable for a given config path, different between fakes.
        tag = zlib.crc32(str(config_path).encode())
        gpus = [
            FakeGpu(uuid=f"GPU-{tag:08x}-fa4e-4000-8000-{i:012x}", memory_mib=size) for i, size in enumerate(sizes_mib)
        ]
        return cls(config_path, library, gpus)

    @classmethod
    def with_layout(cls, config_path: Path, library: Path, layout: str, memory_mib: int = 16384) -> FakeNvml:
        """GPUs linked as a layout of ``tests.fakes.topologies`` ("dgx1", "dgx-a100"...) shows them, through
        the calls the real driver answers: NVLink links to peers or to NVSwitches, PCIe common ancestors,
        NUMA nodes."""
        topology = topologies.layout(layout)
        fake = cls.with_sizes(config_path, library, *[memory_mib] * len(topology.numa))
        fake.set_layout(topology)
        return fake

    def set_layout(self, topology: Topology) -> None:
        """Wire ``self.gpus`` as ``topology`` says. Pairs that all share one NVLink count (a DGX A100) are
        wired through NVSwitches, as that machine is: each GPU's links go to the switches, none to a peer."""
        count = len(self.gpus)
        pairs = [frozenset((a, b)) for a in range(count) for b in range(a + 1, count)]
        nvlink = {pair: topology.link(*pair) for pair in pairs if topology.link(*pair).kind is LinkKind.NVLINK}
        for index, gpu in enumerate(self.gpus):
            gpu.numa = topology.numa.get(index)
            gpu.nvlinks = []
        self.nvswitch_buses = []
        counts = {link.nvlinks for link in nvlink.values()}
        if pairs and len(nvlink) == len(pairs) and len(counts) == 1:
            (per_gpu,) = counts
            self.nvswitch_buses = [SWITCH_BUS + s for s in range(NVSWITCHES)]
            for gpu in self.gpus:
                gpu.nvlinks = [self.nvswitch_buses[link % NVSWITCHES] for link in range(per_gpu)]
        else:
            for pair, link in sorted(nvlink.items(), key=lambda item: sorted(item[0])):
                a, b = sorted(pair)
                self.gpus[a].nvlinks += [self.gpus[b].bus(b)] * link.nvlinks
                self.gpus[b].nvlinks += [self.gpus[a].bus(a)] * link.nvlinks
        known = any(topology.link(*pair).kind is not LinkKind.UNKNOWN for pair in pairs)
        self.ancestors = None
        if known:
            self.ancestors = [[_ancestor(topology, a, b) for b in range(count)] for a in range(count)]
        self.write()

    def write(self) -> None:
        body = {
            "driverVersion": self.driver_version,
            "cudaDriverVersion": 12020,
            "errors": self.errors,
            "nvswitchBuses": self.nvswitch_buses,
            **({"ancestors": self.ancestors} if self.ancestors is not None else {}),
            "devices": [gpu.to_json(i) for i, gpu in enumerate(self.gpus)],
            "events": self._events,
        }
        scratch = self.config_path.with_suffix(".tmp")
        scratch.write_text(json.dumps(body, indent=1))
        scratch.replace(self.config_path)  # atomic: the library never reads half a file

    def set_processes(self, gpu: int, *processes: tuple[int, int] | tuple[int, int, str]) -> None:
        """What NVML lists running on GPU ``gpu``: (pid, used MiB[, "graphics"]); re-read live."""
        self.gpus[gpu].processes = list(processes)
        self.write()

    def set_sm_util(self, gpu: int, **by_pid: int) -> None:
        """The SM use (%) NVML samples for processes of GPU ``gpu``: ``set_sm_util(0, **{"42": 70})``."""
        self.gpus[gpu].sm_util = {int(pid): value for pid, value in by_pid.items()}
        self.write()

    def xid(self, gpu: int, xid: int) -> None:
        """Raise an XID critical error on GPU ``gpu`` (-1: all GPUs)."""
        self._events.append({"id": len(self._events) + 1, "device": gpu, "type": "xid", "xid": xid})
        self.write()

    def env(self) -> dict[str, str]:
        """Environment for a process that should load this fake through the real pynvml."""
        previous = os.environ.get("LD_LIBRARY_PATH")
        search = str(self.library.parent) + (f":{previous}" if previous else "")
        return {"LD_LIBRARY_PATH": search, "FAKE_NVML_CONFIG": str(self.config_path)}

    def preload(self) -> None:
        """Make ``dlopen("libnvidia-ml.so.1")`` in this process find the fake.

        glibc matches an already-loaded object by soname before it searches paths, so pynvml's own CDLL call
        gets this library even though LD_LIBRARY_PATH was fixed when the process started.
        """
        os.environ["FAKE_NVML_CONFIG"] = str(self.config_path)
        ctypes.CDLL(str(self.library), mode=ctypes.RTLD_GLOBAL)
