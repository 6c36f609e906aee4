"""Sums of pod counts over "CPU at most c, size in a range": what a request mix asks of its kinds when many
of them differ.

A :class:`PrefixSums` is a persistent segment tree over the sizes' ranks with one version per distinct CPU
request: version *i* holds every kind whose CPU is at most the *i*-th. Building it costs O(k log k) for k
kinds (each adds one path of log k nodes to the version before), a sum O(log k). The request mix's table of
rows (``fragmentation.RequestMix``) costs CPU values times sizes, which an operator's file of 10,000 kinds
made 1.4 GiB and a minute of the event loop; the mix uses this structure past a small budget of cells.
The tree lives in typed arrays, not lists: a list of a million numbers is a container the garbage collector
walks element by element on each full collection (tens of ms held by whichever thread collects, the event
loop's or the mix builder's), an array is one object it does not look into. Pure.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable


class PrefixSums:
    """``items``: (cpu, size, count) of each kind."""

    def __init__(self, items: Iterable[tuple[int, int, float]]) -> None:
        ordered = sorted(items)
        #: every size, in order: the leaves
        self.sizes = array("q", sorted({size for _, size, _ in ordered}))
        #: the distinct CPU requests, in order, and the tree's root after each
        self.cpus = array("q")
        self._roots = array("q")
        # node 0 is the empty tree; a node is (left child, right child, sum)
        self._left, self._right, self._sum = array("q", [0]), array("q", [0]), array("d", [0.0])
        rank = {size: i for i, size in enumerate(self.sizes)}
        root = 0
        for cpu, size, count in ordered:
            root = self._add(root, rank[size], count)
            if self.cpus and self.cpus[-1] == cpu:
                self._roots[-1] = root
            else:
                self.cpus.append(cpu)
                self._roots.append(root)

    def _add(self, node: int, position: int, count: float) -> int:
        """A new root: ``node``'s tree with ``count`` more at leaf ``position``; the old tree is unchanged."""
        path: list[tuple[int, bool]] = []
        low, high = 0, len(self.sizes) - 1
        while low < high:
            middle = (low + high) // 2
            right = position > middle
            path.append((node, right))
            node = self._right[node] if right else self._left[node]
            low, high = (middle + 1, high) if right else (low, middle)
        made = self._new(0, 0, self._sum[node] + count)
        for parent, right in reversed(path):
            left_child, right_child = self._left[parent], self._right[parent]
            if right:
                right_child = made
            else:
                left_child = made
            made = self._new(left_child, right_child, self._sum[left_child] + self._sum[right_child])
        return made

    def _new(self, left: int, right: int, total: float) -> int:
        self._left.append(left)
        self._right.append(right)
        self._sum.append(total)
        return len(self._sum) - 1

    def total(self, cpu: int | None, above: int = -1, upto: int | None = None) -> float:
        """The counts of the kinds whose CPU is at most ``cpu`` (None: any) and whose size is above
        ``above`` and at most ``upto`` (None: no bound)."""
        version = len(self.cpus) - 1 if cpu is None else bisect.bisect_right(self.cpus, cpu) - 1
        if version < 0 or not self.sizes:
            return 0.0
        first = bisect.bisect_right(self.sizes, above)
        last = len(self.sizes) - 1 if upto is None else bisect.bisect_right(self.sizes, upto) - 1
        if first > last:
            return 0.0
        return self._range(self._roots[version], 0, len(self.sizes) - 1, first, last)

    def _range(self, node: int, low: int, high: int, first: int, last: int) -> float:
        if node == 0:
            return 0.0
        if first <= low and high <= last:
            return self._sum[node]
        middle = (low + high) // 2
        found = 0.0
        if first <= middle:
            found += self._range(self._left[node], low, middle, first, min(last, middle))
        if last > middle:
            found += self._range(self._right[node], middle + 1, high, max(first, middle + 1), last)
        return found
