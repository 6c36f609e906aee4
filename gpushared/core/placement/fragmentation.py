"""How much of a node's free GPU memory is left where the next pods cannot use it: the fragmentation that
the fragment-aware policy (FGD, Weng et al., USENIX ATC'23) keeps from growing.

For one kind of pod (its milli-CPU, GPU memory per GPU and number of GPUs), a node's free GPU memory is
fragment as the paper defines it: all of it when the node cannot host the pod (too little CPU left, too few
GPUs with room, or the pod uses no GPU); otherwise the GPUs with less free than the pod needs on each.
Weighted by how often each kind occurs among the pods seen (the *mix*), that is the node's expected
fragment. Placing a pod changes only its node, so the policy compares that node's expected fragment before
and after.

CPU is what makes this more than best fit: on a trace of shared GPUs the GPU-memory term alone is concave
and picks what best fit picks, while a node whose CPU is used up strands all its free GPU memory.

Where the mix knows the cluster's nodes (their :class:`NodeClass` counts), a kind that only some nodes can
ever host weighs more on those: its share times the nodes there are per node that could host it. The
paper's fragment weighs every kind by its share alone, as if its pods could go anywhere; a kind of 8 GPUs
and 120 CPUs that only 39 of 1,213 nodes can take concentrates all its demand on those 39, and at its
share alone (0.1 % of pods) the growth of breaking one of them is smaller than the levels fgd prices in
can tell, so they were taken by small pods long before the cluster filled (docs/benchmarks.md, "Placement
quality").
Where the mix also knows each node's room now (:class:`NodeRoom`), the nodes that could host a kind are
those that could take it *now*: as the cluster fills, the few nodes left with room for a big kind weigh it
more, when breaking one of them matters most.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from gpushared.contract import GpuInventory
from gpushared.core.placement.prefixsums import PrefixSums

#: A kind of pod: (milli-CPU requested, GPU memory units on each of its GPUs, GPUs); (CPU, 0, 0) for a pod
#: that uses no GPU.
Kind = tuple[int, int, int]
#: A kind of pod and the GPU models it may run on (its node affinity on the cluster's GPU-model label; None:
#: any model).
ModelKind = tuple[int, int, int, frozenset[str] | None]
#: Pods of each kind, with or without models (weighed counts may be fractions).
Counts = Mapping[Kind, float] | Mapping[ModelKind, float] | Mapping[Kind | ModelKind, float]
#: Past this many CPU rows times sizes, one-GPU kinds are kept as sums (``core.placement.prefixsums``), not as a
#: table: a few hundred kinds (the Alibaba trace's 400) stay within it, and so compute exactly as before.
TABLE_CELLS = 1 << 16
#: Past this many (size, GPUs) groups of kinds on several GPUs, they are kept as sums too: each node's
#: fragment would otherwise walk every group (the trace has a handful).
GANG_GROUPS = 64
#: At most this many whole-node kinds (``RequestMix.whole_node_kinds``; most GPUs first, then most CPU): every
#: node class's view weighs each, so a cluster of thousands of shapes no other covers would cost classes
#: times shapes on every mix. The Alibaba trace's 1,213 nodes have 13 shapes; one covers all the others.
MAX_WHOLE_NODE_KINDS = 32


class NodeClass(NamedTuple):
    """What a node offers any pod, whatever runs on it: its GPU model (the cluster's GPU-model label; None:
    not known), its GPUs, the memory units of its largest GPU, and the milli-CPU pods may request there
    (None: not known)."""

    model: str | None
    gpus: int
    gpu_memory: int
    cpu: int | None


def node_class(inventory: GpuInventory, *, model: str | None, cpu_allocatable: int | None) -> NodeClass:
    return NodeClass(
        model, len(inventory.gpus), max((gpu.memory for gpu in inventory.gpus), default=0), cpu_allocatable
    )


class NodeRoom(NamedTuple):
    """What a node has left now: its GPU model, each GPU's free memory units (largest first), and the
    milli-CPU left to requests (None: not known)."""

    model: str | None
    frees: tuple[int, ...]
    cpu: int | None


def node_room(frees: Iterable[int], *, model: str | None, cpu_free: int | None) -> NodeRoom:
    return NodeRoom(model, tuple(sorted(frees, reverse=True)), cpu_free)


def hosts_now(rooms: Mapping[NodeRoom, int], kinds: Iterable[ModelKind]) -> dict[ModelKind, int]:
    """For each kind, the nodes (``rooms[room]`` of each room) that could take one such pod now: the right
    model, CPU left, and as many GPUs with room for its size as it asks.

    A sweep, not every node for every kind: per GPU model and number of GPUs asked, the kinds in falling size and the
    rooms in falling free memory of their n-th GPU; each room's CPU goes into a sorted list as the size
    falls to what it holds, and a kind's count is the rooms there with CPU enough. 5,000 nodes and a few
    hundred kinds cost milliseconds, which the extender pays each time it counts a mix."""
    wanted = list(dict.fromkeys(kinds))
    found: dict[ModelKind, int] = {}
    by_model: dict[frozenset[str] | None, list[tuple[NodeRoom, int]]] = {}
    for models in {kind[3] for kind in wanted}:
        by_model[models] = [
            (room, n) for room, n in rooms.items() if models is None or room.model is None or room.model in models
        ]
    for (models, gpus), group in _grouped(wanted).items():
        # (the n-th largest free, the room's CPU, how many such rooms), largest free first
        able = sorted(
            ((room.frees[gpus - 1], room.cpu, n) for room, n in by_model[models] if len(room.frees) >= gpus),
            key=lambda entry: -entry[0],
        )
        cpus: list[int] = []  # every CPU entry once per node, for a count by bisect
        unknown = 0
        taken = 0
        for kind in sorted(group, key=lambda k: -k[1]):
            cpu, size = kind[0], kind[1]
            while taken < len(able) and able[taken][0] >= size:
                _, room_cpu, n = able[taken]
                if room_cpu is None:
                    unknown += n
                else:
                    at = bisect.bisect_left(cpus, room_cpu)
                    cpus[at:at] = [room_cpu] * n
                taken += 1
            found[kind] = unknown + len(cpus) - bisect.bisect_left(cpus, cpu)
    return found


def _grouped(kinds: Iterable[ModelKind]) -> dict[tuple[frozenset[str] | None, int], list[ModelKind]]:
    groups: dict[tuple[frozenset[str] | None, int], list[ModelKind]] = {}
    for kind in kinds:
        groups.setdefault((kind[3], max(kind[2], 1)), []).append(kind)
    return groups


def hosts(node: NodeClass, kind: ModelKind) -> bool:
    """Whether an empty node of this class could take a pod of this kind."""
    cpu, size, gpus, models = kind
    return (
        (models is None or node.model is None or node.model in models)
        and gpus <= node.gpus
        and size <= node.gpu_memory
        and (node.cpu is None or cpu <= node.cpu)
    )


def whole_node_kinds(nodes: Iterable[NodeClass], unseen: float) -> dict[ModelKind, float]:
    """A pod that would take a whole node (all its CPU and GPUs, each GPU whole) of each shape no larger
    node covers (no other has as many GPUs, as much CPU and as large GPUs), ``unseen`` pods of each:
    what a mix that knows no workload yet assumes may come. A fresh extender's mix has not seen the rare
    big kinds, and its fragment prices none of them; pods that fit best on the largest nodes (balanced
    CPU and GPU) then break the few that could host them before the first comes (cpu200, 3 seeds
    of 10: every node of 8 GPUs and 128 CPUs broken by one-GPU pods by 35 % arrived, the tasks of 8 GPUs
    and 120 CPUs refused from 40 %). Weighed by scarcity like any kind, it weighs most on the
    few nodes that could take it. A shape that a larger node covers is not assumed: its whole node is
    common, and weighing it kept many nodes whole for pods that never came (gpushare40: 0.7 points
    lost from 100 % arrived, with every shape assumed). Empty where ``unseen`` is 0 or the nodes are
    not known; these kinds are never counted as pods (``len``, the pressures)."""
    if not unseen:
        return {}
    shapes = {(node.gpus, node.cpu, node.gpu_memory) for node in nodes if node.cpu is not None}
    largest: list[tuple[int, int, int]] = []
    # Largest first, so a shape's every dominator comes before it, and any that is not kept is dominated
    # by one that is: checking the kept ones suffices.
    for shape in sorted((shape for shape in shapes if shape[0] > 0 and shape[2] > 0), reverse=True):
        if not any(all(mine >= theirs for mine, theirs in zip(kept, shape, strict=True)) for kept in largest):
            largest.append(shape)
            if len(largest) == MAX_WHOLE_NODE_KINDS:
                break
    return {(cpu, memory, gpus, None): unseen for gpus, cpu, memory in largest}


def _model_pressures(
    kinds: Mapping[ModelKind, float], nodes: Mapping[NodeClass, int], rooms: Mapping[NodeRoom, int] | None
) -> tuple[dict[str, float], dict[str, float]]:
    """(``RequestMix.pressure``, ``RequestMix.projected_pressure``) of every GPU model the cluster has."""
    gpus: dict[str, int] = {}
    memory: dict[str, int] = {}
    for node, n in nodes.items():
        if node.model is not None:
            gpus[node.model] = gpus.get(node.model, 0) + n * node.gpus
            memory[node.model] = max(memory.get(node.model, 0), node.gpu_memory)
    all_gpus = sum(gpus.values())
    mean_memory = sum(gpus[m] * memory[m] for m in gpus) / all_gpus if all_gpus else 0.0
    wanted: dict[str, float] = {}
    demand = 0.0
    for (_, size, count, models), pods in kinds.items():
        if size <= 0:
            continue
        demand += pods * count * (min(1.0, size / mean_memory) if mean_memory else 1.0)
        allowed = [m for m in gpus if models is not None and m in models]
        if not allowed or len(allowed) == len(gpus):
            continue  # no model the cluster has, or any the cluster has: pinned to none
        for m in allowed:
            share = min(1.0, size / memory[m]) if memory[m] else 1.0
            wanted[m] = wanted.get(m, 0.0) + pods * count * share / len(allowed)
    counted = {m: wanted.get(m, 0.0) / g for m, g in gpus.items() if g}
    left = {m: float(g) for m, g in gpus.items()}
    if rooms is not None:
        left = dict.fromkeys(gpus, 0.0)
        for room, n in rooms.items():
            if room.model in left and memory[room.model]:
                left[room.model] += n * sum(room.frees) / memory[room.model]
    all_left = sum(left.values())
    projected = {}
    for m in gpus:
        if wanted.get(m) and demand:
            share = wanted[m] / demand
            projected[m] = min(1.0, share * all_left / left[m]) if left[m] > 0 else 1.0
    return counted, projected


class RequestMix:
    """The popularity of pod kinds among the pods seen: what the next ones will ask.

    Kept as one row per distinct CPU request: for the kinds that ask at most that much CPU, their GPU sizes
    in order and the share of kinds larger than each. A node's expected fragment then costs one search for
    its CPU left and one per GPU, whatever the number of kinds. Kinds on several GPUs (whole-GPU training
    jobs, mostly: few sizes) are kept per (size, GPUs), each with its CPU requests in order.

    Immutable: the extender counts a new one now and then and swaps it in whole, so request threads never
    see one half-counted.
    """

    #: per GPU model, counted on first use (:meth:`pressure`, :meth:`projected_pressure`)
    _pressures: tuple[dict[str, float], dict[str, float]] | None

    def __init__(
        self,
        kinds: Iterable[Kind | ModelKind] = (),
        *,
        nodes: Mapping[NodeClass, int] | None = None,
        rooms: Mapping[NodeRoom, int] | None = None,
        unseen: float = 0.0,
    ) -> None:
        #: the cluster's nodes, counted by class (empty: not known, every kind weighs its share alone)
        self.nodes: dict[NodeClass, int] = {c: n for c, n in (nodes or {}).items() if n > 0}
        #: the same nodes by what they have left now (None: not known; the classes say who could host)
        self.rooms: Mapping[NodeRoom, int] | None = rooms
        #: pods of each whole-node kind (:meth:`whole_node_kinds`) the views weigh beside the kinds counted
        self.unseen = unseen
        self._whole: dict[ModelKind, float] | None = None
        #: for each kind, the nodes that could host it now (counted from ``rooms`` when first asked)
        self._able_now: dict[ModelKind, int] | None = None
        self._count(Counter(kinds))

    @classmethod
    def of_counts(
        cls,
        counts: Counts,
        *,
        nodes: Mapping[NodeClass, int] | None = None,
        rooms: Mapping[NodeRoom, int] | None = None,
        unseen: float = 0.0,
    ) -> RequestMix:
        """The mix of ``counts[kind]`` pods of each kind: what a cache that keeps counts hands over."""
        mix = cls(nodes=nodes, rooms=rooms, unseen=unseen)
        mix._count(counts)
        return mix

    def kinds(self) -> dict[ModelKind, float]:
        """The kinds of pod counted, and how many of each."""
        return dict(self._kinds)

    def with_rooms(self, rooms: Mapping[NodeRoom, int]) -> RequestMix:
        """The same kinds and nodes, with what the nodes have left now."""
        return RequestMix.of_counts(self._kinds, nodes=self.nodes, rooms=rooms, unseen=self.unseen)

    def whole_node_kinds(self) -> dict[ModelKind, float]:
        """The kinds this mix assumes beside those counted (:func:`whole_node_kinds`), found once per mix:
        every class's view reads them."""
        if self._whole is None:
            self._whole = whole_node_kinds(self.nodes, self.unseen)
        return self._whole

    def for_node(self, node: NodeClass) -> RequestMix:
        """The mix as a node of this class sees it: kinds that may not run on its GPU model as in
        :meth:`for_model`, and, where the mix knows the cluster's nodes, each kind this class could host
        weighed by how scarce its hosts are (the module's docstring). Kept per class."""
        if not self.nodes:
            return self.for_model(node.model)
        view = self._views.get(node)
        if view is None:
            counts: dict[Kind, float] = {}
            whole = self.whole_node_kinds()
            seen = ((kind, n, True) for kind, n in self._kinds.items())
            assumed = ((kind, n, False) for kind, n in whole.items())
            for kind, n, now in (*seen, *assumed):
                cpu, size, gpus, models = kind
                if models is not None and node.model is not None and node.model not in models:
                    key, weight = (cpu, 0, 0), 1.0
                else:
                    scarce = size > 0 and hosts(node, kind)
                    key, weight = (cpu, size, gpus), self._scarcity(kind, now=now) if scarce else 1.0
                counts[key] = counts.get(key, 0.0) + n * weight
            view = self._views[node] = RequestMix()
            view._count(counts, total=self._total + sum(whole.values()))
        return view

    def _scarcity(self, kind: ModelKind, *, now: bool = True) -> float:
        """The cluster's nodes per node that could host ``kind``: 1 for a kind every node could host; with
        rooms known and ``now``, per node that could host it now (at least one: a kind no node has room
        for now weighs as if one had). A whole-node kind, assumed and not seen, weighs by the nodes that
        could host it empty (``now`` False): by what is left now, the last whole nodes would be kept, at
        hundreds of times its weight, for a pod that may never come."""
        known = self._scarcities.get((kind, now))
        if known is None:
            if self.rooms is not None and now:
                able_now = self._able_now
                if able_now is None:
                    able_now = self._able_now = hosts_now(self.rooms, self._kinds)
                known = sum(self.nodes.values()) / max(able_now.get(kind, 0), 1)
            else:
                able = sum(n for node, n in self.nodes.items() if hosts(node, kind))
                known = sum(self.nodes.values()) / able if able else 1.0
            self._scarcities[(kind, now)] = known
        return known

    def pressure(self, model: str | None) -> float:
        """How much of the cluster's GPUs of ``model`` the pods pinned to a few models will want: for each
        kind whose node affinity allows some but not all of the models the cluster has, its pods times its
        GPUs times its share of a GPU, split evenly among the models it allows; summed for ``model`` and
        divided by the cluster's GPUs of that model. 0 where no kind is pinned, ``model`` is not known, or
        the mix does not know the cluster's nodes. Pods that may run anywhere are priced off the models
        pinned pods press on (``PricingContext.pressure``), so those find room there (docs/benchmarks.md,
        "Placement quality")."""
        return 0.0 if model is None else self._pressure_tables()[0].get(model, 0.0)

    def projected_pressure(self, model: str | None) -> float:
        """How much of what is left of ``model``'s GPUs the pods pinned to a few models will want as the
        cluster fills: their share of the GPU demand in the mix (spread over the models each allows, as in
        :meth:`pressure`) times the GPUs left in the cluster, over the model's GPUs left; at most 1. With
        ``rooms`` not known, what is left is every GPU. Where :meth:`pressure` counts the pinned pods seen,
        and so starts near 0 while few have come, this follows their share of the workload from the first;
        and a model filled faster than the cluster (by pods that could have run anywhere) is pressed the
        harder for it (the counted pressure let the T4s fill on gpuspec05)."""
        return 0.0 if model is None else self._pressure_tables()[1].get(model, 0.0)

    def pressures(self) -> tuple[tuple[str, float], ...]:
        """Every GPU model's :meth:`pressure`, as one value two mixes can be compared by: a price that reads
        the mix only through the pressure is the same under both when these are (empty: none anywhere)."""
        return tuple(sorted((m, p) for m, p in self._pressure_tables()[0].items() if p))

    def _pressure_tables(self) -> tuple[dict[str, float], dict[str, float]]:
        """(:meth:`pressure`, :meth:`projected_pressure`) per GPU model, counted on first use; empty where no
        kind is pinned or the mix does not know the cluster's nodes."""
        if not self._pinned or not self.nodes:
            return {}, {}
        if self._pressures is None:
            self._pressures = _model_pressures(self._kinds, self.nodes, self.rooms)
        return self._pressures

    def for_model(self, model: str | None) -> RequestMix:
        """The mix as a node of GPU ``model`` sees it: a kind that may not run on that model cannot use any
        of the node's GPU memory, like a pod without GPU, so all of it is fragment to that kind. The same
        mix when no kind names models (or the node's model is not known)."""
        if model is None or not self._pinned:
            return self
        view = self._views.get(model)
        if view is None:
            counts: dict[Kind, float] = {}
            for (cpu, size, gpus, models), n in self._kinds.items():
                key = (cpu, size, gpus) if models is None or model in models else (cpu, 0, 0)
                counts[key] = counts.get(key, 0.0) + n
            view = self._views[model] = RequestMix.of_counts(counts)
        return view

    def _count(self, given: Counts, total: float | None = None) -> None:
        #: every kind with the models it may use, and whether any names models
        self._kinds: dict[ModelKind, float] = {}
        for kind, n in given.items():
            full: ModelKind = (kind[0], kind[1], kind[2], kind[3] if len(kind) == 4 else None)
            self._kinds[full] = self._kinds.get(full, 0) + n
        self._pinned = any(models is not None for *_, models in self._kinds)
        self._views: dict[str | NodeClass, RequestMix] = {}
        self._scarcities: dict[tuple[ModelKind, bool], float] = {}
        self._pressures = None
        self._able_now = None
        merged: dict[Kind, float] = {}
        for (cpu, size, gpus, _), n in self._kinds.items():
            merged[(cpu, size, gpus)] = merged.get((cpu, size, gpus), 0.0) + n
        self._count_kinds(merged, total)

    def _count_kinds(self, given: Mapping[Kind, float], total: float | None) -> None:
        """``total``: the pods the shares are of (None: the counts' sum; a weighed view keeps its mix's)."""
        counts = {kind: n for kind, n in given.items() if n > 0}
        total = sum(counts.values()) if total is None else total
        self._total = total
        gpu = {(cpu, size): n for (cpu, size, gpus), n in counts.items() if size > 0 and gpus == 1}
        gpu_total = sum(gpu.values())
        gangs = {kind: n for kind, n in counts.items() if kind[1] > 0 and kind[2] > 1}
        #: share of pods using no GPU: all free GPU memory is fragment to them
        self._gpuless = sum(n for (_, size, _), n in counts.items() if size <= 0) / total if total else 0.0
        #: (size per GPU, GPUs) -> (CPU requests in order, share of the kinds asking at most each)
        self._gangs: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
        #: past GANG_GROUPS groups, per number of GPUs: each gang kind's share by CPU and size (a sum per
        #: node then costs the node's distinct frees, not the groups), and the share of all gang kinds
        self._gang_sums: dict[int, PrefixSums] = {}
        self._gang_share = sum(gangs.values()) / total if total else 0.0
        if len({(size, gpus) for _, size, gpus in gangs}) > GANG_GROUPS:
            for count in {gpus for _, _, gpus in gangs}:
                picked = ((cpu, size, n / total) for (cpu, size, gpus), n in gangs.items() if gpus == count)
                self._gang_sums[count] = PrefixSums(picked)
        else:
            for cpu, size, gpus in sorted(gangs):
                cpus, shares = self._gangs.setdefault((size, gpus), ([], []))
                shares.append((shares[-1] if shares else 0.0) + gangs[(cpu, size, gpus)] / total)
                cpus.append(cpu)
        self._cpus = tuple(sorted({cpu for cpu, _ in gpu}))
        self._gpu_total = gpu_total
        #: per CPU row: (sizes of the kinds asking at most that CPU, share of them larger than sizes[i - 1]),
        #: and the share of GPU pods that ask more CPU than the row's (they cannot use the node at all)
        self._rows: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
        self._unhosted: list[float] = []
        #: past TABLE_CELLS rows times sizes, the one-GPU kinds by CPU and size instead of that table
        self._sums: PrefixSums | None = None
        self._all_gpu = gpu_total / total if total else 0.0
        if len(self._cpus) * len({size for _, size in gpu}) > TABLE_CELLS:
            self._sums = PrefixSums((cpu, size, n) for (cpu, size), n in gpu.items())
            return
        sizes: dict[int, float] = {}
        by_cpu: dict[int, list[tuple[int, float]]] = {}
        for (cpu, size), n in gpu.items():
            by_cpu.setdefault(cpu, []).append((size, n))
        hosted = 0.0
        for cpu in self._cpus:
            for size, n in by_cpu[cpu]:
                sizes[size] = sizes.get(size, 0.0) + n
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

    def __len__(self) -> int:
        return round(self._total)

    def fragment(self, frees: Iterable[int], *, cpu_free: int | None = None) -> float:
        """Expected units of a node's free GPU memory (``frees``, one per GPU) that the next pod cannot use,
        given the node's milli-CPU left (None: not known, so no pod is turned away for CPU)."""
        frees = [f for f in frees if f > 0]
        if not self._total or not frees:
            return 0.0
        total = sum(frees)
        row = len(self._cpus) if cpu_free is None else bisect.bisect_right(self._cpus, cpu_free)
        if not row:  # not even the smallest CPU request fits: no one-GPU pod can use any of it
            fragment = float(total) * (self._gpuless + self._all_gpu)
        elif self._sums is not None:
            sums, pods = self._sums, self._total
            lost = self._gpuless + (self._gpu_total - sums.total(cpu_free)) / pods
            fragment = sum(free * (lost + sums.total(cpu_free, above=free) / pods) for free in frees)
        else:
            sizes, above = self._rows[row - 1]
            lost = self._gpuless + self._unhosted[row - 1]
            fragment = sum(free * (lost + above[bisect.bisect_right(sizes, free)]) for free in frees)
        for (size, gpus), (cpus, shares) in self._gangs.items():
            hosted = 0.0
            if sum(1 for free in frees if free >= size) >= gpus:
                asking = len(cpus) if cpu_free is None else bisect.bisect_right(cpus, cpu_free)
                hosted = shares[asking - 1] if asking else 0.0
            fragment += (shares[-1] - hosted) * total + hosted * sum(free for free in frees if free < size)
        if self._gang_sums:
            fragment += self._gang_fragment(frees, total, cpu_free)
        return fragment

    def _gang_fragment(self, frees: list[int], total: int, cpu_free: int | None) -> float:
        """The gang kinds' part of :meth:`fragment` from their sums: every gang kind's share of all ``total``,
        less, for those the node can host (their size at most its ``gpus``-th largest free, CPU at most
        ``cpu_free``), their share of what they would use: all but the GPUs with less free than their size."""
        ordered = sorted(frees, reverse=True)
        cuts = sorted(set(frees))
        fragment = self._gang_share * total
        for gpus, sums in self._gang_sums.items():
            if len(ordered) < gpus:
                continue
            reach, low, below = ordered[gpus - 1], 0, 0  # sizes in (low, cut] leave the frees up to low
            for cut in cuts:
                hosted = sums.total(cpu_free, above=low, upto=min(cut, reach))
                fragment += hosted * (below - total)
                if cut >= reach:
                    break
                below += cut * frees.count(cut)
                low = cut
        return fragment
