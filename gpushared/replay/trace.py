"""The trace's node and pod lists, and how a GPU share becomes GPU memory.

The trace gives each task a *share* of one GPU (``gpu_milli``, 1000 = a whole GPU), not memory. gpushared
schedules memory, so the replay models every GPU with ``GPU_MIB`` of memory and asks ``gpu_milli / 1000`` of
it, rounded to the MiB: the allocation ratio in memory is then the paper's ratio in shares, so our numbers
and the paper's are comparable. Real sizes differ (P100, T4, V100M16 16 GB; V100M32 32 GB; A10 24 GB; G2/G3
undisclosed, 77 % of the GPUs), but a task's share says nothing about which memory it would need on a
bigger GPU, so any per-model sizing would invent demand the trace does not have.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: The memory every GPU is modelled with: 16 GiB, the size of most GPUs of a disclosed model in the trace.
GPU_MIB = 16384
#: kube-scheduler's default maximum of pods per node (kubelet --max-pods), which NodeResourcesFit checks.
MAX_PODS = 110


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    #: GPU models it may run on (``gpu_spec``); empty: any
    models: frozenset[str] = frozenset()

    @property
    def gpu_demand(self) -> int:
        """GPU milli it asks for in all: the trace's measure of arrived workload."""
        return self.num_gpu * self.gpu_milli

    @property
    def memory_per_gpu(self) -> int:
        """GPU memory (MiB) the task takes on each of its GPUs; 0 for a CPU-only task."""
        return round(self.gpu_milli * GPU_MIB / 1000) if self.num_gpu else 0

    @property
    def compute_request(self) -> int:
        """Its GPU share as a compute request (``gpushared.io/gpu-compute-request``, percent of each of its
        GPUs), rounded up: a task is guaranteed at least its share. 0 for a CPU-only task."""
        return -(-self.gpu_milli // 10) if self.num_gpu else 0

    @property
    def memory_request(self) -> int:
        """The task's gpu-mem request (MiB): its memory on all its GPUs (``gpu-count`` is ``num_gpu``)."""
        return self.memory_per_gpu * self.num_gpu


def read_nodes(path: Path) -> list[TraceNode]:
    return [
        TraceNode(
            name=row["sn"],
            cpu_milli=int(row["cpu_milli"]),
            memory_mib=int(row["memory_mib"]),
            gpus=int(row["gpu"]),
            model=row["model"],
        )
        for row in _rows(path)
        if int(row["gpu"]) > 0
    ]


def read_pods(path: Path) -> list[TracePod]:
    """Every task of a pod list; the multigpu files have no gpu_spec column (no model constraints)."""
    return [
        TracePod(
            name=row["name"],
            cpu_milli=int(row["cpu_milli"]),
            memory_mib=int(row["memory_mib"]),
            num_gpu=int(row["num_gpu"]),
            gpu_milli=int(row["gpu_milli"]),
            models=frozenset(m for m in (row.get("gpu_spec") or "").split("|") if m),
        )
        for row in _rows(path)
    ]


def _rows(path: Path) -> Iterator[dict[str, str]]:
    with path.open(newline="") as stream:
        yield from csv.DictReader(stream)
