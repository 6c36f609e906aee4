"""Which pods to evict from one node so that a higher-priority pod fits on its GPUs: the preempt verb, decided.

kube-scheduler's own preemption counts GPU memory as one number per node: it evicts pods that free memory on
the node but not room on one GPU, and the pod stays Pending (a 10 GiB pod beside a 6 GiB pod killed on a GPU
with 6 GiB free). For each node it proposes, the extender answers with :func:`select_victims`: the pods whose
eviction gives the preemptor ``request.gpus`` GPUs that fit, by the same predicate the filter uses
(``verdicts.fitting`` on the ledger without the victims), so "fits" means here exactly what it means there.

Who may go: pods of strictly lower priority than the preemptor (an :class:`Occupant` says each pod's). Never a
holding without an occupant, a ``kept`` holding (room kept for kube-scheduler, not a pod), or one with
``pending`` units (its GPUs are not known, so evicting it frees no known GPU; its units stay counted).

Which set: of the sets that make the pod fit, the one with

1. the lowest highest victim priority: the least important pods go;
2. then the fewest PodDisruptionBudget violations (counted as kube-scheduler counts them, :func:`pdb_violations`);
3. then the fewest victims;
4. then the lowest sum of victim priorities;
5. then, for a pod on several GPUs, the best-linked GPUs it gets (``topology.set_score``), then the lowest
   GPU indexes, then the victims' uids: the answer is deterministic.

kube-scheduler ranks whole *nodes* by PDB violations before the highest priority; within the node the victims'
priority comes first here because it is what can be found exactly at any size (the threshold below), so a pod
is never evicted while one of lower priority would do.

The search, bounded (a node has a few dozen pods and at most 16 GPUs, and every subset of its pods is too many):

- Evicting more never makes a GPU worse (memory, compute, MPS mode, MPS clients), but for an MPS pod on a GPU
  with MPS clients and plain pods both (it serves MPS pods until its last client goes). So each GPU has a
  *threshold*, the lowest priority at which evicting its pods at or below it makes it fit (or all of them but
  one MPS client, on such a GPU): a fit check per distinct priority on it (and per client kept). The lowest
  highest victim priority the pod can have is the ``request.gpus``-th lowest threshold, or, where pods on
  several GPUs tie them together, the next priority up that finds a set.
- The GPU sets tried are ``request.gpus`` of the GPUs whose threshold is at most ``T``: all of them while they
  number at most :data:`SET_LIMIT` (every set of an 8-GPU node), else those of the GPUs with the lowest
  thresholds, the longest prefix whose sets number at most that.
- For each set, the pods on it of priority at most ``T`` are the candidates. Pods of the other sharing mode
  (MPS beside plain) on the set must all go. The rest are searched exactly, every subset in order of size,
  supersets of a set that fits skipped, while their subsets number at most the fit checks left of
  :data:`CHECK_BUDGET`; beyond, greedily (largest first, then without PDB-protected pods first, then lowest
  priority first; each then reprieved, highest priority first) and only while the budget lasts. Worst case
  measured: about 0.1 s for 16 full GPUs of 48 pods and a pod on 8 of them; a few ms for most nodes.
- The chosen set is reprieved once more against the whole node: no victim can be spared.

So a call makes at most about (GPUs x distinct priorities) + :data:`CHECK_BUDGET` + one greedy pass of fit checks,
each updating a private copy of the ledger by the victims' holdings alone. Below the budget (every node the
tests draw) the answer is the best by the order above; beyond, the rest is best effort (criterion 1 held in
every drawn case), and the set always fits and spares no victim it could.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, NamedTuple

from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import PodRequest
from gpushared.core.shared.topology import choose_set, set_score, topology_of
from gpushared.core.shared.verdicts import MAX_MPS_CLIENTS, fitting

#: GPU sets tried per node: C(8, 4), every set of an 8-GPU node.
SET_LIMIT: Final = 70
#: Fit checks per node for the exact search of victims and the greedy beyond it.
CHECK_BUDGET: Final = 4096

_NO_PDBS: Final[Mapping[str, int]] = MappingProxyType({})


@dataclass(frozen=True)
class Occupant:
    """What the decision knows of a pod on the node beside its holding."""

    priority: int
    #: names of the PodDisruptionBudgets that select it
    pdbs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Victims:
    """The pods to evict from one node for the preemptor, and what it gets there once they are gone."""

    #: in the order they should go: lowest priority first, then by uid
    uids: tuple[str, ...]
    #: the GPU indexes the preemptor gets, ascending
    gpus: tuple[int, ...]
    #: the highest priority among the victims (kube-scheduler compares nodes by it); None: no victim
    highest_priority: int | None
    pdb_violations: int


def select_victims(
    ledger: Ledger,
    request: PodRequest,
    *,
    priority: int,
    occupants: Mapping[str, Occupant],
    pdb_allowed: Mapping[str, int] = _NO_PDBS,
    max_mps_clients: int = MAX_MPS_CLIENTS,
) -> Victims | None:
    """The victims that make ``request`` (of ``priority``) fit on ``ledger``'s node, or None when no set of
    lower-priority pods does (the node is dropped). A pod that fits already gets an empty :class:`Victims`
    with the GPUs it would get (``highest_priority`` None): the node needs no eviction. ``pdb_allowed`` is
    each PodDisruptionBudget's disruptions left, by the names ``Occupant.pdbs`` use; a name it lacks counts
    no violation."""
    if request.per_gpu <= 0:
        return None  # fitting finds no GPU for a pod that asks for no memory, whatever goes
    return _Search(
        ledger,
        request=request,
        priority=priority,
        occupants=occupants,
        pdb_allowed=pdb_allowed,
        max_mps_clients=max_mps_clients,
    ).run()


def pdb_violations(
    victims: Iterable[str], occupants: Mapping[str, Occupant], pdb_allowed: Mapping[str, int] = _NO_PDBS
) -> int:
    """The victims, in the order they go, that violate a PodDisruptionBudget: as kube-scheduler counts them,
    each takes one disruption from every budget that selects it, and violates when one had none left."""
    left = dict(pdb_allowed)
    count = 0
    for uid in victims:
        names = [name for name in occupants[uid].pdbs if name in left]
        count += any(left[name] <= 0 for name in names)
        for name in names:
            left[name] -= 1
    return count


#: (highest priority, PDB violations, victims, sum of priorities, -link score, GPUs, uids): lower is better
_Key = tuple[int, int, int, int, int, tuple[int, ...], tuple[str, ...]]


class NodeVictims(NamedTuple):
    """One node where the preemptor fits once its victims go, with the victims' priorities."""

    node: str
    victims: Victims
    priorities: tuple[int, ...]


def pick_node(options: Iterable[NodeVictims]) -> NodeVictims | None:
    """The node to preempt on, as kube-scheduler picks one among its candidates (``pickOneNodeForPreemption``):
    the fewest PodDisruptionBudget violations, then the lowest highest victim priority, then the lowest sum of
    victim priorities, then the fewest victims, then the node's name."""

    def key(option: NodeVictims) -> tuple[int, float, int, int, str]:
        highest = option.victims.highest_priority
        return (
            option.victims.pdb_violations,
            -math.inf if highest is None else highest,
            sum(option.priorities),
            len(option.victims.uids),
            option.node,
        )

    return min(options, key=key, default=None)


class _Search:
    """One call's state: the working copy of the ledger, the pods that may go, and the fit checks left."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        request: PodRequest,
        priority: int,
        occupants: Mapping[str, Occupant],
        pdb_allowed: Mapping[str, int],
        max_mps_clients: int,
    ) -> None:
        self.request, self.occupants, self.pdb_allowed = request, occupants, pdb_allowed
        self.max_mps_clients = max_mps_clients
        # a private copy, so that the caller's ledger (and the views cached on it) is never touched
        self.work = Ledger.build(ledger.inventory, ledger.holdings())
        self.topology = topology_of(ledger.inventory)
        self.checks_left = CHECK_BUDGET
        #: GPU -> the MPS client its threshold keeps (``thresholds``): the greedy search leaves it there
        self.keeps: dict[int, Holding] = {}
        self.eligible = sorted(
            (
                h
                for h in ledger.holdings()
                if h.uid in occupants
                and occupants[h.uid].priority < priority
                and not h.kept
                and not h.pending
                and h.gpus
            ),
            key=self.order,
        )

    def order(self, holding: Holding) -> tuple[int, str]:
        """The order victims go in: lowest priority first, then by uid."""
        return self.occupants[holding.uid].priority, holding.uid

    def priority(self, holding: Holding) -> int:
        return self.occupants[holding.uid].priority

    def fits(self, gone: Collection[Holding]) -> set[int]:
        """The GPUs that fit the pod once ``gone`` are evicted: ``fitting`` on the ledger without them."""
        for holding in gone:
            self.work.remove(holding.uid)
        try:
            return {v.gpu.index for v in fitting(self.work, self.request, max_mps_clients=self.max_mps_clients)}
        finally:
            for holding in gone:
                self.work.add(holding)

    def run(self) -> Victims | None:
        need = self.request.gpus
        now = self.fits(())
        if len(now) >= need:
            return Victims(uids=(), gpus=self.gpus_of(now), highest_priority=None, pdb_violations=0)
        thresholds = self.thresholds(now)
        if len(thresholds) < need:
            return None
        ranked = sorted(thresholds, key=lambda i: (thresholds[i], i))
        # The lowest level first: the need-th lowest threshold, then each higher priority while no set of GPUs
        # finds victims (pods on two of its GPUs, or an MPS client kept on one, can tie GPUs' thresholds together).
        first = thresholds[ranked[need - 1]]
        for top in sorted({first, *(self.priority(h) for h in self.eligible if self.priority(h) > first)}):
            reachable = [i for i in ranked if thresholds[i] <= top]
            width = len(reachable)
            while width > need and math.comb(width, need) > SET_LIMIT:
                width -= 1
            found: dict[frozenset[str], tuple[Holding, ...]] = {}
            for gpus in itertools.combinations(sorted(reachable[:width]), need):
                if found and self.checks_left <= 0:
                    break
                for victims in self.for_set(frozenset(gpus), top):
                    found.setdefault(frozenset(h.uid for h in victims), victims)
            if found:
                best = min(self.key(victims) for victims in found.values())
                chosen = self.reprieve(found[frozenset(best[6])], lambda gone: len(self.fits(gone)) >= need)
                return self.victims(chosen)
        return None

    def thresholds(self, now: set[int]) -> dict[int, int]:
        """For each GPU that some eviction makes fit, the lowest priority such that evicting pods on it of that
        priority or lower does (a GPU that fits already: lower than any pod's).

        Evicting more never makes a GPU worse, but for one case: a GPU with MPS clients and plain pods (a
        ledger shows what the cluster holds) serves MPS pods, and once its last client is gone it serves plain
        ones. So for an MPS pod such a GPU fits at a level either with every pod at or below it evicted, or
        with all of them but one MPS client (keeping more only takes more room)."""
        floor = min((self.priority(h) for h in self.eligible), default=0) - 1
        found = {}
        for gpu in self.work.inventory.gpus:
            index = gpu.index
            if index in now:
                found[index] = floor
                continue
            on_gpu = [h for h in self.eligible if index in h.gpus]
            keep_one = self.request.mps and self.mixed(index)
            for level in sorted({self.priority(h) for h in on_gpu}):
                gone = [h for h in on_gpu if self.priority(h) <= level]
                kept = [h for h in gone if h.mps] if keep_one else []
                if index in self.fits(gone):
                    found[index] = level
                    break
                keep = next((k for k in kept if index in self.fits([h for h in gone if h is not k])), None)
                if keep is not None:
                    found[index], self.keeps[index] = level, keep
                    break
        return found

    def mixed(self, index: int) -> bool:
        """Whether GPU ``index`` has MPS clients and plain pods both."""
        sharing = {h.mps for h in self.work.holdings() if index in h.gpus and not h.kept}
        return len(sharing) == 2

    def for_set(self, gpus: frozenset[int], top: int) -> list[tuple[Holding, ...]]:
        """The best victim sets that make every GPU of ``gpus`` fit, among the pods on them of priority at most
        ``top``: all those tied on (PDB violations, victims, sum of priorities) when searched exactly."""
        candidates = [h for h in self.eligible if self.priority(h) <= top and not gpus.isdisjoint(h.gpus)]
        # a pod of the other sharing mode keeps the pod off its GPU: every such pod goes. (For an MPS pod, a
        # plain pod only on a GPU without MPS clients: beside one that stays, the GPU still serves MPS pods.)
        forced = tuple(h for h in candidates if h.mps != self.request.mps and self.blocks(h, gpus))
        rest = [h for h in candidates if h not in forced]
        if 2 ** len(rest) <= self.checks_left:
            return self.exact(gpus, forced, rest)
        return self.greedy(gpus, forced, rest)

    def blocks(self, holding: Holding, gpus: frozenset[int]) -> bool:
        """Whether ``holding``, of the other sharing mode, keeps the pod off one of ``gpus`` while it stays."""
        if not self.request.mps:
            return True  # a GPU with an MPS client serves MPS pods alone
        return any(self.work.mps_clients(index) == 0 for index in gpus.intersection(holding.gpus))

    def exact(
        self, gpus: frozenset[int], forced: tuple[Holding, ...], rest: list[Holding]
    ) -> list[tuple[Holding, ...]]:
        """Every subset of ``rest`` beside ``forced``, fewest first; a superset of one that fits is never
        better (more victims, no fewer violations: an added victim only takes disruptions from the others)."""
        best: tuple[int, int, int] | None = None
        tied: list[tuple[Holding, ...]] = []
        fitted: list[frozenset[str]] = []
        floor = self.violations(forced)
        for size in range(len(rest) + 1):
            if best is not None and best[0] == floor:
                break  # a larger set has as many violations at least, and more victims
            for extra in itertools.combinations(rest, size):
                uids = frozenset(h.uid for h in extra)
                if any(done <= uids for done in fitted):
                    continue
                victims = tuple(sorted(forced + extra, key=self.order))
                rank = (self.violations(victims), len(victims), sum(self.priority(h) for h in victims))
                if best is not None and rank > best:
                    continue
                self.checks_left -= 1
                if not gpus <= self.fits(victims):
                    continue
                fitted.append(uids)
                if best is None or rank < best:
                    best, tied = rank, []
                tied.append(victims)
        return tied

    def greedy(
        self, gpus: frozenset[int], forced: tuple[Holding, ...], rest: list[Holding]
    ) -> list[tuple[Holding, ...]]:
        """Victims added in a few orders until every GPU of ``gpus`` fits, each then reprieved: too many pods
        for the exact search. The MPS client a GPU's threshold keeps stays (else evicting it could leave the
        GPU to plain pods that may not go); once more without, in the first order."""

        def freed(h: Holding) -> int:
            return -sum(units for index, units in h.gpus.items() if index in gpus)

        def protected(h: Holding) -> bool:
            return any(self.pdb_allowed.get(name, 1) <= 0 for name in self.occupants[h.uid].pdbs)

        orders: list[Callable[[Holding], tuple[int | bool | str, ...]]] = [
            lambda h: (freed(h), -h.compute, *self.order(h)),
            lambda h: (protected(h), freed(h), *self.order(h)),
            lambda h: (*self.order(h), freed(h)),
        ]
        found: list[tuple[Holding, ...]] = []
        keeps = {self.keeps[index].uid for index in gpus if index in self.keeps}
        runs = [(order, keeps) for order in orders] + ([(orders[0], set())] if keeps else [])
        for order, left in runs:
            if found and self.checks_left <= 0:
                break
            chosen = list(forced)
            for holding in sorted((h for h in rest if h.uid not in left), key=order):
                missing = gpus - self.counted_fits(chosen)
                if not missing:
                    break
                if not missing.isdisjoint(holding.gpus):
                    chosen.append(holding)
            if gpus <= self.counted_fits(chosen):
                kept = self.reprieve(
                    tuple(chosen), lambda gone: gpus <= self.counted_fits(gone), keep=frozenset(h.uid for h in forced)
                )
                found.append(kept)
        return found

    def counted_fits(self, gone: Collection[Holding]) -> set[int]:
        self.checks_left -= 1
        return self.fits(gone)

    def reprieve(
        self,
        victims: tuple[Holding, ...],
        enough: Callable[[list[Holding]], bool],
        keep: frozenset[str] = frozenset(),
    ) -> tuple[Holding, ...]:
        """``victims`` less each one, highest priority first (the smallest first among equals), whose eviction
        is not needed for ``enough``: no victim can be spared."""
        chosen = list(victims)
        spared = True
        while spared:  # again until none is spared: once an MPS client stays, a plain pod may be spared too
            spared = False
            spare = sorted(
                (h for h in chosen if h.uid not in keep),
                key=lambda h: (-self.priority(h), sum(h.gpus.values()), h.uid),
            )
            for holding in spare:
                without = [h for h in chosen if h.uid != holding.uid]
                if enough(without):
                    chosen, spared = without, True
        return tuple(sorted(chosen, key=self.order))

    def violations(self, victims: Sequence[Holding]) -> int:
        return pdb_violations((h.uid for h in victims), self.occupants, self.pdb_allowed)

    def gpus_of(self, fit: Collection[int]) -> tuple[int, ...]:
        """The preemptor's GPUs among those that fit: the best-linked, then the lowest indexes."""
        return tuple(sorted(choose_set(sorted(fit), self.request.gpus, self.topology)))

    def key(self, victims: tuple[Holding, ...]) -> _Key:
        gpus = self.gpus_of(self.fits(victims))
        priorities = [self.priority(h) for h in victims]
        return (
            max(priorities),
            self.violations(victims),
            len(victims),
            sum(priorities),
            -set_score(gpus, self.topology),
            gpus,
            tuple(sorted(h.uid for h in victims)),
        )

    def victims(self, chosen: tuple[Holding, ...]) -> Victims:
        return Victims(
            uids=tuple(h.uid for h in chosen),
            gpus=self.gpus_of(self.fits(chosen)),
            highest_priority=max(self.priority(h) for h in chosen),
            pdb_violations=self.violations(chosen),
        )
