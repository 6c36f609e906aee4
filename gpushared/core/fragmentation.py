"""How much of a node's free GPU memory is left where the next pods cannot use it: the fragmentation that
the fragment-aware policy (FGD, Weng et al., USENIX ATC'23) keeps from growing.

For one kind of pod (its milli-CPU and GPU memory), a node's free GPU memory is fragment as the paper
defines it: all of it when the node cannot host the pod (too little CPU left, no GPU with room, or the pod
uses no GPU); otherwise the GPUs with less free than the pod needs. Weighted by how often each kind occurs
among the pods seen (the *mix*), that is the node's expected fragment. Placing a pod changes only its
node, so the policy compares that node's expected fragment before and after.

CPU is what makes this more than best fit: on a trace of shared GPUs the GPU-memory term alone is concave
and picks what best fit picks, while a node whose CPU is used up strands all its free GPU memory.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping

#: A kind of pod: (milli-CPU requested, GPU memory units requested; 0 for a pod that uses no GPU).
Kind = tuple[int, int]


class RequestMix:
    """The popularity of pod kinds among the pods seen: what the next ones will ask.

    Kept as one row per distinct CPU request: for the kinds that ask at most that much CPU, their GPU sizes
    in order and the share of kinds larger than each. A node's expected fragment then costs one search for
    its CPU left and one per GPU, whatever the number of kinds.

    Immutable: the extender counts a new one now and then and swaps it in whole, so request threads never
    see one half-counted.
    """

    def __init__(self, kinds: Iterable[Kind] = ()) -> None:
        self._count(Counter(kinds))

    @classmethod
    def of_counts(cls, counts: Mapping[Kind, int]) -> RequestMix:
        """The mix of ``counts[kind]`` pods of each kind: what a cache that keeps counts hands over."""
        mix = cls()
        mix._count(counts)
        return mix

    def _count(self, given: Mapping[Kind, int]) -> None:
        counts = {kind: n for kind, n in given.items() if n > 0}
        total = sum(counts.values())
        self._total = total
        gpu = {kind: n for kind, n in counts.items() if kind[1] > 0}
        gpu_total = sum(gpu.values())
        #: share of pods using no GPU: all free GPU memory is fragment to them
        self._gpuless = (total - gpu_total) / total if total else 0.0
        self._cpus = tuple(sorted({cpu for cpu, _ in gpu}))
        #: per CPU row: (sizes of the kinds asking at most that CPU, share of them larger than sizes[i - 1]),
        #: and the share of GPU pods that ask more CPU than the row's (they cannot use the node at all)
        self._rows: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
        self._unhosted: list[float] = []
        sizes: Counter[int] = Counter()
        by_cpu: dict[int, list[tuple[int, int]]] = {}
        for (cpu, size), n in gpu.items():
            by_cpu.setdefault(cpu, []).append((size, n))
        hosted = 0
        for cpu in self._cpus:
            for size, n in by_cpu[cpu]:
                sizes[size] += n
                hosted += n
            ordered = tuple(sorted(sizes))
            above: list[float] = []
            remaining = hosted
            for size in ordered:
                above.append(remaining / total)
                remaining -= sizes[size]
            above.append(0.0)
            self._rows.append((ordered, tuple(above)))
            self._unhosted.append((gpu_total - hosted) / total)
        self._all_gpu = gpu_total / total if total else 0.0

    def __len__(self) -> int:
        return self._total

    def fragment(self, frees: Iterable[int], *, cpu_free: int | None = None) -> float:
        """Expected units of a node's free GPU memory (``frees``, one per GPU) that the next pod cannot use,
        given the node's milli-CPU left (None: not known, so no pod is turned away for CPU)."""
        frees = [f for f in frees if f > 0]
        if not self._total or not frees:
            return 0.0
        row = len(self._cpus) if cpu_free is None else bisect.bisect_right(self._cpus, cpu_free)
        if not row:  # not even the smallest CPU request fits: no pod can use any of it
            return float(sum(frees)) * (self._gpuless + self._all_gpu)
        sizes, above = self._rows[row - 1]
        lost = self._gpuless + self._unhosted[row - 1]
        return sum(free * (lost + above[bisect.bisect_right(sizes, free)]) for free in frees)
