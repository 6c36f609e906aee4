"""The book of what the pods seen ask for, and the request mixes taken from it: what fgd's fragment and
binpack's pressure may know of the workload, and only what has been seen.

A pod's *kind* (:func:`kind_of`) is counted when it is counted on a node and uncounted when it goes; now and
then a new :class:`RequestMix` is taken from the counts (:meth:`MixBook.take`), with the cluster's nodes by
class and, for a policy that weighs scarcity, what each node has left then. The extender's cache counts
the pods its watch shows bound (``extender/state.py``, a mix every 10 s); the trace replay counts the tasks
it has placed (``replay/cluster.py``, a mix every 5 % of the capacity): the same book, so the replay knows
of the workload exactly what a running extender would, and nothing of the tasks still to come.

What a running extender may know before it has seen a pod is what its operator tells it: an
:class:`ExpectedMix` (the extender's ``--expected-mix`` file, written by ``kubectl inspect gpushare
--expected-mix`` from a cluster's pods, or from another trace for the replay), counted as ``weight`` pods
beside the pods seen. Without it a fresh extender's mix would be empty, and fgd would price no fragment
for the big kinds it has not yet seen: the first pods break the few nodes that could host those. So a book
with no expected mix has every mix assume ``unseen`` pods that would each take a whole node of the largest
shapes (``RequestMix.whole_node_kinds``), never counted as pods.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpushared.contract import ContractError
from gpushared.core.placement.fragmentation import ModelKind, NodeClass, NodeRoom, RequestMix
from gpushared.core.shared.ledger import Holding

#: How many pods an expected mix counts as, unless its file says: beside it, the pods seen take over once
#: there are some thousands of them. Chosen by scripts/tune_placement.py: bench/results/tuning-placement.json.
EXPECTED_WEIGHT: Final = 1000.0
#: Kinds an expected mix may list: a cluster's pods have some dozens to hundreds (the Alibaba trace's 8,152
#: tasks are 400 kinds), and `kubectl inspect gpushare --expected-mix` writes one per kind it saw; 2,000 is
#: five times the trace's. Each kind costs the extender on every mix it takes, on its event loop (10,000
#: kinds, once accepted, held it 61 s); a larger file is refused at start (docs/benchmarks.md, "What an
#: expected mix costs").
MAX_EXPECTED_KINDS: Final = 2_000
#: Pods of each whole-node kind (``RequestMix.whole_node_kinds``: a pod that would take a whole node of a
#: class) a mix counts beside the pods seen where the operator gave no expected mix: what a fresh extender
#: assumes may come before it has seen the rare big kinds. An expected mix says what to expect instead.
#: Chosen by scripts/tune_placement.py with no expected mix; figures: bench/results/tuning-unseen.json.
UNSEEN_WEIGHT: Final = 1.0


def kind_of(cpu: int, holding: Holding | None, models: frozenset[str] | None) -> ModelKind:
    """A pod's kind in the request mix: its CPU, what it holds (or waits for) on each GPU, its GPUs, and the
    GPU models it may use (None: any)."""
    if holding is None:
        return request_kind(cpu, 0, 0, None)
    if len(holding.gpus) > 1:
        return request_kind(cpu, max(holding.gpus.values()), len(holding.gpus), models)
    return request_kind(cpu, sum(holding.gpus.values()) + holding.pending, 1, models)


def request_kind(cpu: int, per_gpu: int, gpus: int, models: frozenset[str] | None) -> ModelKind:
    """The kind of a pod that asks ``per_gpu`` units on each of ``gpus`` GPUs: one that asks no GPU memory
    is a CPU pod, whatever models or GPU count it names."""
    if not per_gpu or not gpus:
        return cpu, 0, 0, None
    return cpu, per_gpu, gpus, models


@dataclass(frozen=True)
class ExpectedMix:
    """The kinds of pod an operator expects, each with its share (the shares sum to 1), counted as
    ``weight`` pods in every mix taken."""

    shares: Mapping[ModelKind, float]
    weight: float = EXPECTED_WEIGHT

    @classmethod
    def of_counts(cls, counts: Mapping[ModelKind, float], *, weight: float = EXPECTED_WEIGHT) -> ExpectedMix:
        total = sum(n for n in counts.values() if n > 0)
        return cls({kind: n / total for kind, n in counts.items() if n > 0} if total else {}, weight)

    def counts(self) -> dict[ModelKind, float]:
        return {kind: share * self.weight for kind, share in self.shares.items()}


def expected_mix_document(counts: Mapping[ModelKind, float], *, weight: float = EXPECTED_WEIGHT) -> dict[str, object]:
    """The document :func:`read_expected_mix` reads, of the pods counted by kind (largest counts first)."""
    kinds = [
        {
            "cpuMilli": cpu,
            "gpuMem": size,
            "gpus": gpus,
            **({"models": sorted(models)} if models is not None else {}),
            "count": round(n, 6),
        }
        for (cpu, size, gpus, models), n in sorted(counts.items(), key=lambda item: (-item[1], str(item[0])))
        if n > 0
    ]
    return {"weight": weight, "kinds": kinds}


def read_expected_mix(document: object, *, key: str = "expected mix") -> ExpectedMix:
    """An operator's expected mix: ``{"weight": pods, "kinds": [{"cpuMilli": int, "gpuMem": int (per GPU, in
    the gpu-mem resource's units), "gpus": int, "models": [str] (optional: any model), "count": number}]}``.
    A kind's share is its count over the counts' sum. Every fault is a ContractError naming the entry."""
    if not isinstance(document, dict):
        raise ContractError(key=key, value=document, reason="expected a JSON object with 'kinds'")
    unknown = set(document) - {"weight", "kinds"}
    if unknown:
        raise ContractError(key=key, value=sorted(unknown), reason="unknown keys; expected 'weight' and 'kinds'")
    weight = document.get("weight", EXPECTED_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1e9:
        raise ContractError(key=f"{key}: weight", value=weight, reason="expected a number of pods, 0 to 1e9")
    kinds = document.get("kinds")
    if not isinstance(kinds, list) or len(kinds) > MAX_EXPECTED_KINDS:
        raise ContractError(
            key=f"{key}: kinds", value=kinds, reason=f"expected a list of at most {MAX_EXPECTED_KINDS:,}"
        )
    counts: dict[ModelKind, float] = {}
    for i, entry in enumerate(kinds):
        kind, count = _expected_kind(entry, key=f"{key}: kinds[{i}]")
        counts[kind] = counts.get(kind, 0.0) + count
    if kinds and not sum(counts.values()):
        raise ContractError(key=f"{key}: kinds", value=len(kinds), reason="every count is 0")
    return ExpectedMix.of_counts(counts, weight=float(weight))


def _expected_kind(entry: object, *, key: str) -> tuple[ModelKind, float]:
    if not isinstance(entry, dict):
        raise ContractError(key=key, value=entry, reason="expected an object")
    unknown = set(entry) - {"cpuMilli", "gpuMem", "gpus", "models", "count"}
    if unknown:
        raise ContractError(key=key, value=sorted(unknown), reason="unknown keys")
    numbers = []
    for name, top in (("cpuMilli", 10**9), ("gpuMem", 10**9), ("gpus", 1024)):
        value = entry.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise ContractError(key=f"{key}.{name}", value=value, reason=f"expected an integer from 0 to {top:,}")
        numbers.append(value)
    cpu, size, gpus = numbers
    if (size == 0) != (gpus == 0):
        raise ContractError(key=key, value=entry, reason="'gpuMem' and 'gpus' are both 0 (no GPU) or both above 0")
    count = entry.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not 0 <= count <= 1e12:
        raise ContractError(key=f"{key}.count", value=count, reason="expected a number from 0 to 1e12")
    models = entry.get("models")
    if models is not None and (
        not isinstance(models, list)
        or not models
        or len(models) > 64
        or not all(isinstance(m, str) and 0 < len(m) <= 253 for m in models)
    ):
        raise ContractError(key=f"{key}.models", value=models, reason="expected 1 to 64 GPU model names")
    chosen = frozenset(models) if models is not None and size else None
    return (cpu, size, gpus, chosen), float(count)


class MixBook:
    """``expected``: what the operator expects, counted in every mix beside the pods counted here; without
    it (or of weight 0), ``unseen`` pods of each whole-node kind are weighed instead (``UNSEEN_WEIGHT``)."""

    def __init__(self, expected: ExpectedMix | None = None, *, unseen: float = UNSEEN_WEIGHT) -> None:
        #: pods counted, by kind
        self.kinds: Counter[ModelKind] = Counter()
        #: the expected mix as pods (none where its weight is 0)
        self._expected_counts = {k: n for k, n in (expected.counts() if expected else {}).items() if n > 0}
        #: pods of each whole-node kind every mix taken weighs (``RequestMix.whole_node_kinds``)
        self.unseen = 0.0 if self._expected_counts else unseen
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
        return self.install(RequestMix.of_counts(self.counts(), nodes=nodes, rooms=rooms, unseen=self.unseen))

    def counts(self) -> dict[ModelKind, float]:
        """The pods counted now and the expected ones, by kind: what a mix is taken of (a copy)."""
        merged = dict(self._expected_counts)
        for kind, n in self.kinds.items():
            merged[kind] = merged.get(kind, 0.0) + n
        return merged

    def install(self, mix: RequestMix) -> RequestMix:
        """``mix`` (of :meth:`counts`, taken now or a moment ago) as the book's latest."""
        self.mix_generation += 1
        if mix.pressures() != self.mix.pressures():
            self.pressure_generation += 1
        self.mix = mix
        return mix


def built_mix(
    counts: Mapping[ModelKind, float],
    *,
    nodes: Mapping[NodeClass, int],
    rooms: Mapping[NodeRoom, int] | None,
    unseen: float = 0.0,
) -> RequestMix:
    """A mix with everything a node's price reads of it worked out already (the view of each node class, the
    pressures), for a caller that builds it away from where it is read: the extender, off its event loop."""
    mix = RequestMix.of_counts(counts, nodes=nodes, rooms=rooms, unseen=unseen)
    for node in nodes:
        mix.for_node(node)
    mix.pressures()
    return mix
