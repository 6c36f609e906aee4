"""What a policy may weigh beside the GPU it prices (``core.placement.policies``): the node's pricing context.

The request mix as the node sees it, the free memory of its healthy GPUs (and, where pods hold compute,
how much of it their compute leaves usable), the node's CPU and the pod's; worked out on first use and,
what derives from the ledger alone, kept on the ledger until it changes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gpushared.core.placement.fragmentation import RequestMix, node_class
from gpushared.core.shared.ledger import GpuVerdict, Ledger
from gpushared.core.shared.verdicts import by_free


@dataclass(frozen=True)
class NodeCpu:
    """A node's CPU as kube-scheduler's NodeResourcesFit counts it, in milli-CPU: what pods may request in
    all, and what the pods bound to it request."""

    allocatable: int
    requested: int


_NO_MIX: Final = RequestMix()


class PricingContext:
    """What a policy may weigh beside the GPU it prices: the mix of pods seen, the free memory of every
    healthy GPU of the node, and the node's CPU and the pod's (unknown CPU: None).

    Worked out on first use: best fit and spread read none of it, and the extender prices a thousand nodes
    per call.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        mix: RequestMix = _NO_MIX,
        cpu: NodeCpu | None = None,
        pod_cpu: int = 0,
        model: str | None = None,
        pinned: bool = False,
        pod_compute: int = 0,
    ):
        self.ledger = ledger
        self.cpu = cpu
        self.pod_cpu = pod_cpu
        #: the pod's compute request, percent of each of its GPUs (0: none)
        self.pod_compute = pod_compute
        #: whether the pod priced may run only on some GPU models (its node affinity names them)
        self.pinned = pinned
        self._mix, self._model = mix, model
        self._node_mix: RequestMix | None = None
        self._known_gpus: tuple[dict[int, int], list[int], int, int] | None = None

    @property
    def mix(self) -> RequestMix:
        """The mix as this node sees it (``RequestMix.for_node``): kinds that may not run on its GPU model
        (``model``, the value of the cluster's GPU-model label; None: not known) can use none of its GPU
        memory, and kinds few nodes can host weigh more on those. Worked out on first use (only fgd reads
        it), kept as a plain attribute for the reason :attr:`_gpus` gives."""
        known = self._node_mix
        if known is None:
            cpu = None if self.cpu is None else self.cpu.allocatable
            node = node_class(self.ledger.inventory, model=self._model, cpu_allocatable=cpu)
            known = self._node_mix = self._mix.for_node(node)
        return known

    @property
    def pressure(self) -> float:
        """How much of this node's GPU model the pods pinned to few models will want (``RequestMix.pressure``),
        for a pod that may run anywhere; 0 for a pinned pod, which has no other place to go."""
        return 0.0 if self.pinned else self._mix.pressure(self._model)

    @property
    def projected_pressure(self) -> float:
        """How much of what is left of this node's GPU model the pods pinned to few models will want as the
        cluster fills (``RequestMix.projected_pressure``), for a pod that may run anywhere; 0 for a pinned pod."""
        return 0.0 if self.pinned else self._mix.projected_pressure(self._model)

    @property
    def _gpus(self) -> tuple[dict[int, int], list[int], int, int]:
        """(GPU index -> position, free units per position, units in all, free units in all) of the healthy
        GPUs. A plain attribute check rather than functools.cached_property, whose lock (Python 3.11) cost
        more than the lookup when a thousand nodes are priced."""
        known = self._known_gpus
        if known is None:
            known = self._known_gpus = _healthy_gpus(self.ledger)
        return known

    @property
    def mix_pods(self) -> int:
        """How many pods the mix knows of: those counted so far and the operator's expected ones."""
        return len(self._mix)

    @property
    def whole(self) -> bool:
        """Whether none of the node's healthy GPU memory is taken (and it has some)."""
        return 0 < self.capacity <= self.free_total

    @property
    def free_total(self) -> int:
        """Free units on the node's healthy GPUs, in all."""
        return self._gpus[3]

    @property
    def capacity(self) -> int:
        """Units on the node's healthy GPUs, in all."""
        return self._gpus[2]

    @property
    def cpu_free(self) -> int | None:
        return None if self.cpu is None else self.cpu.allocatable - self.cpu.requested

    @functools.cached_property
    def _usable(self) -> list[int]:
        """Each healthy GPU's free memory as the fragment sees it: where pods hold compute (compute shares),
        no more than its unrequested compute expressed in its memory (``_usable_free``): memory left on a
        GPU whose compute is taken is stranded, as a node's free GPU memory is when its CPU is (FGD's
        second dimension). The free memory itself where no pod holds compute."""
        position, frees, _, _ = self._gpus
        if not self.ledger.holds_compute:
            return frees
        by_index = {gpu.index: gpu for gpu in self.ledger.inventory.gpus}
        usable = list(frees)
        for index, at in position.items():
            usable[at] = _usable_free(frees[at], self.ledger.compute_free(index), by_index[index].memory)
        return usable

    @functools.cached_property
    def _fragment(self) -> float:
        return self.mix.fragment(self._usable, cpu_free=self.cpu_free)

    def growth(self, verdicts: Sequence[GpuVerdict], need: int) -> float:
        """How much the node's expected fragment (``RequestMix.fragment``) grows when the pod takes ``need``
        units, and its compute request, of each of the verdicts' GPUs."""
        position, frees, _, _ = self._gpus
        after = list(self._usable)
        compute = self.pod_compute
        for verdict in verdicts:
            at = position[verdict.gpu.index]
            if compute or self.ledger.holds_compute:
                left = self.ledger.compute_free(verdict.gpu.index) - compute
                after[at] = _usable_free(frees[at] - need, left, verdict.gpu.memory)
            else:
                after[at] -= need
        cpu_free = self.cpu_free
        left_cpu = None if cpu_free is None else cpu_free - self.pod_cpu
        return self.mix.fragment(after, cpu_free=left_cpu) - self._fragment

    def imbalance(self, need: int) -> float:
        """How far apart the node's shares of CPU and of GPU memory left would be with the pod on it. A node
        that runs out of CPU first strands its GPU memory, and one that runs out of GPU memory its CPU."""
        _, frees, capacity, _ = self._gpus
        cpu_free = self.cpu_free
        if self.cpu is None or cpu_free is None or self.cpu.allocatable <= 0 or capacity <= 0:
            return 0.0
        cpu_left = (cpu_free - self.pod_cpu) / self.cpu.allocatable
        return abs(cpu_left - (sum(frees) - need) / capacity)


def _usable_free(free: int, compute_free: int, memory: int) -> int:
    """A GPU's free memory, capped at its unrequested compute as a share of its memory: exact for pods that
    ask compute in proportion to memory (the trace's tasks: one GPU share for both), and for the others
    the memory a pod of average compute could still use."""
    return min(free, max(compute_free, 0) * memory // 100)


def _healthy_gpus(ledger: Ledger) -> tuple[dict[int, int], list[int], int, int]:
    """What :attr:`PricingContext._gpus` says of the ledger, kept on it until it changes (every pod size
    priced on the node reads the same)."""
    views = ledger.views()
    if views.healthy is not None:
        return views.healthy
    healthy = [gpu for gpu in ledger.inventory.gpus if gpu.healthy]
    frees = [max(ledger.free(gpu), 0) for gpu in healthy]
    capacity = sum(gpu.memory for gpu in healthy)
    gpus = views.healthy = {gpu.index: i for i, gpu in enumerate(healthy)}, frees, capacity, sum(frees)
    return gpus


def derive_pricing(ledger: Ledger) -> None:
    """Work out now what pricing reads from the ledger as it is (the usable GPUs of a plain pod, the free
    memory of the healthy ones), kept on it until it changes: the extender does it for every node before it
    says ready, so the first call for a request size prices, and does not also derive."""
    by_free(ledger, mps=False)
    _healthy_gpus(ledger)
