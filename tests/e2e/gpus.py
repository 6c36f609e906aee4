"""The local cluster's simulated GPUs: what the fake ``libnvidia-ml.so.1`` shows (a JSON file it re-reads
on change), the processes it lists on each GPU, and the GPUs' device files under the daemon's devRoot.

While the node runs as a DRA driver (tests/e2e/test_dra.py's ``dra_node``), its GPUs (16, 12, 24 and 8 GiB)
are joined in two NVLink pairs, 0-2 and 1-3, each by two links, and meet nowhere closer than across the
sockets otherwise (``nvidia-smi topo -m``: NV2 and SYS): a DRA claim for two linked GPUs (``matchAttribute:
gpu.gpushared.io/nvlinkDomain``) has two domains to choose from, and the claim allocator's policy takes
another pair than kube-scheduler's first fit (tests/e2e/test_dra_allocator.py). In device-plugin mode no
link is known, as a driver that does not say: the device-plugin cases' placements (the demo's samples, the
gpu-count cases) are those they were written for.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from gpushared.core.shared.topology import Link, LinkKind, Topology
from tests.fakes.nvml import FakeNvml, build_library

#: The node's NVLink pairs (by NVML index) and the links joining each.
NVLINK_PAIRS = ((0, 2), (1, 3))
NVLINKS_PER_PAIR = 2


class SimulatedGpus:
    def __init__(self, state: Path) -> None:
        #: the fake NVML library's GPUs (JSON, re-read by the library on change)
        self.file = state / "nvml" / "gpus.json"
        #: the daemon's devRoot: device files for ``deviceNodes``, the real /dev left alone
        self.dev_root = state / "dev-root"

    def write_gpus(self, sizes_mib: Sequence[int], nvlink: Sequence[tuple[int, int]] = ()) -> FakeNvml:
        """GPUs of these sizes, joined by NVLink as ``nvlink`` says (pairs past the GPUs left out; none: no
        link known, as a driver that does not say)."""
        fake = FakeNvml.with_sizes(self.file, build_library(self.file.parent), *sizes_mib)
        pairs = [(a, b) for a, b in nvlink if max(a, b) < len(sizes_mib)]
        if pairs:
            links = {frozenset(pair): Link(LinkKind.NVLINK, NVLINKS_PER_PAIR) for pair in pairs}
            fake.set_layout(Topology(links=links))
        return fake

    def write_layout(self, layout: str, size_mib: int) -> FakeNvml:
        """GPUs of ``size_mib`` linked as a layout of ``tests.fakes.topologies`` ("dgx1"...)."""
        return FakeNvml.with_layout(self.file, build_library(self.file.parent), layout, size_mib)

    def gpu_count(self) -> int:
        """How many GPUs the fake NVML shows now."""
        return len(json.loads(self.file.read_text())["devices"])

    def set_gpu_processes(self, index: int, processes: Sequence[tuple[int, int]]) -> None:
        """What the fake NVML lists on GPU ``index``: (host PID, MiB); the daemon reads it on its next poll."""
        body = json.loads(self.file.read_text())
        body["devices"][index]["processes"] = [{"pid": pid, "usedMiB": mib} for pid, mib in processes]
        scratch = self.file.with_suffix(".tmp")
        scratch.write_text(json.dumps(body, indent=1))
        scratch.replace(self.file)

    def clear_gpu_processes(self) -> None:
        for index in range(self.gpu_count()):
            self.set_gpu_processes(index, [])

    def make_device_nodes(self, count: int) -> None:
        """The fake GPUs' device files, for deviceNodes: harmless character devices (/dev/null's numbers)
        named as the driver names them, under the daemon's devRoot; the real /dev is left alone."""
        dev = self.dev_root / "dev"
        dev.mkdir(parents=True, exist_ok=True)
        for name in [f"nvidia{minor}" for minor in range(count)] + ["nvidiactl", "nvidia-uvm"]:
            if not (dev / name).exists():
                os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(1, 3))
