"""How much GPU memory is left in pieces too small for what pods ask: the fragmentation that the
fragment-aware policy (FGD, Weng et al., USENIX ATC'23) keeps from growing.

A GPU with ``free`` units left is a fragment, for a pod that needs more than ``free``, to the amount of
``free``: that pod cannot use it. Weighted by how often each request size occurs (the *mix*), a GPU's
expected fragment is ``free * P(request > free)``, and a cluster's is the sum over its GPUs. Placing a pod
changes only the GPU it lands on, so the policy compares that one GPU's expected fragment before and after.

The paper's node-level fragment also counts a node's free GPU as lost when its CPU or memory cannot host a
pod; the extender sees GPU memory only (kube-scheduler's own filters handle CPU and memory), so that term is
left to the scheduler.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping


class RequestMix:
    """The popularity of request sizes (in gpu-mem units) among the pods seen: what the next ones will ask.

    Immutable: the extender counts a new one now and then and swaps it in whole, so request threads never
    see one half-counted.
    """

    def __init__(self, sizes: Iterable[int] = ()) -> None:
        self._count(Counter(sizes))

    @classmethod
    def of_counts(cls, counts: Mapping[int, int]) -> RequestMix:
        """The mix of ``counts[size]`` requests of each size: what a cache that keeps counts hands over."""
        mix = cls()
        mix._count(counts)
        return mix

    def _count(self, given: Mapping[int, int]) -> None:
        counts = {size: n for size, n in given.items() if size > 0 and n > 0}
        self._total = sum(counts.values())
        self._sizes = tuple(sorted(counts))
        above: list[float] = []  # above[i]: share of requests larger than sizes[i - 1]
        remaining = self._total
        for size in self._sizes:
            above.append(remaining / self._total)
            remaining -= counts[size]
        above.append(0.0)
        self._above = tuple(above)

    def __len__(self) -> int:
        return self._total

    def larger_than(self, free: int) -> float:
        """Share of requests that need more than ``free`` units."""
        return self._above[bisect.bisect_right(self._sizes, free)]

    def fragment(self, free: int) -> float:
        """Expected units of a GPU with ``free`` left that the next pod cannot use."""
        return free * self.larger_than(free) if free > 0 else 0.0

    def growth(self, free: int, need: int) -> float:
        """How much the expected fragment grows when ``need`` units of a GPU with ``free`` are taken."""
        return self.fragment(free - need) - self.fragment(free)
