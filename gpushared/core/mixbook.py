"""The book of what the pods seen ask for, and the request mixes taken from it: what fgd's fragment and
binpack's pressure may know of the workload, and only what has been seen.

A pod's *kind* (:func:`kind_of`) is counted when it is counted on a node and uncounted when it goes; now and
then a new :class:`RequestMix` is taken from the counts (:meth:`MixBook.take`), with the cluster's nodes by
class and, for a policy that weighs scarcity, what each node has left then. The extender's cache counts
the pods its watch shows bound (``extender/state.py``, a mix every 10 s); the trace replay counts the tasks
it has placed (``replay/cluster.py``, a mix every 5 % of the capacity): the same book, so the replay knows
of the workload exactly what a running extender would, and nothing of the tasks still to come.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from gpushared.core.fragmentation import ModelKind, NodeClass, NodeRoom, RequestMix
from gpushared.core.ledger import Holding


def kind_of(cpu: int, holding: Holding | None, models: frozenset[str] | None) -> ModelKind:
    """A pod's kind in the request mix: its CPU, what it holds (or waits for) on each GPU, its GPUs, and the
    GPU models it may use (None: any)."""
    if holding is None:
        return cpu, 0, 0, None
    if len(holding.gpus) > 1:
        return cpu, max(holding.gpus.values()), len(holding.gpus), models
    size = sum(holding.gpus.values()) + holding.pending
    return cpu, size, 1 if size else 0, models if size else None


class MixBook:
    def __init__(self) -> None:
        #: pods counted, by kind
        self.kinds: Counter[ModelKind] = Counter()
        #: the mix taken last (empty until the first :meth:`take`)
        self.mix = RequestMix()
        #: counts the mixes taken: a rank that reads the mix is kept per mix
        self.mix_generation = 0
        #: counts the mixes whose pressures differ from the mix before: a rank that reads only those
        #: (``Policy.reads_pressure``) is kept across mixes that leave them as they were
        self.pressure_generation = 0

    def count(self, kind: ModelKind) -> None:
        self.kinds[kind] += 1

    def uncount(self, kind: ModelKind) -> None:
        self.kinds[kind] -= 1
        if self.kinds[kind] <= 0:
            del self.kinds[kind]

    def take(self, *, nodes: Mapping[NodeClass, int], rooms: Mapping[NodeRoom, int] | None = None) -> RequestMix:
        """A new mix of the pods counted now, on the cluster's ``nodes`` by class (and what they have left,
        ``rooms``, for a policy that weighs scarcity); it costs the number of distinct kinds, not of pods."""
        mix = RequestMix.of_counts(self.kinds, nodes=nodes, rooms=rooms)
        self.mix_generation += 1
        if mix.pressures() != self.mix.pressures():
            self.pressure_generation += 1
        self.mix = mix
        return mix
