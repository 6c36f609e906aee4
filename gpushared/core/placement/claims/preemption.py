"""Which pods to evict so that a gated pod's claims fit on a node: the claim allocator's preemption, decided.

A claim's devices are held for as long as a pod it is reserved for (``status.reservedFor``) exists: a claim
made from a template is deleted with its pod, and kube-controller-manager deallocates a standalone claim once
its last pod is gone. So what can be evicted is a *group*: pods that share claims, with every claim reserved
for them. Evicting a group frees all of its claims' devices, and nothing less frees any.

Each group whose pods all have a lower priority than the preemptor becomes one occupant of the node's ledger,
its claims' devices one holding, and the choice is the extender's own (``core.placement.preemption``'s
:func:`~gpushared.core.placement.preemption.select_victims`): the fewest, lowest-priority groups whose
eviction gives the preemptor its GPUs, by the predicate the allocator places with (``verdicts.fitting``).
Held back, exactly as they hold now: claims reserved for no pod (allocated, not bound yet: the allocator's
own, or another pod's in flight), claims of a pod the cache does not show, groups with a pod of the
preemptor's priority or higher, and groups whose devices one holding cannot stand for (different compute
shares on their GPUs, MPS and plain claims, or two MPS clients on one GPU). Groups whose pods all terminate
already are counted gone: their room is on its way, and no one more is evicted for it. GPUs the node's
slices do not publish are never given out, so they count as full.

Pure: the allocator says which claims are on the node, which pods reserve them, and what each pod is.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from gpushared.contract import ComputeShare, MemoryUnit
from gpushared.core.placement.claims.asks import ClaimAsk
from gpushared.core.placement.claims.choice import parts
from gpushared.core.placement.preemption import Occupant, select_victims
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest

#: How a group stands in the ledger the choice is made on, and how unpublished GPUs are filled.
GROUP_UID = "claim-group"
UNPUBLISHED_UID = "unpublished-gpu"


@dataclass(frozen=True)
class ClaimPod:
    """A pod a claim on the node is reserved for, as the choice reads it."""

    priority: int
    #: being deleted already: its claims' room is on its way
    terminating: bool = False
    #: the PodDisruptionBudgets that select it (names ``pdb_allowed`` uses)
    pdbs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClaimVictims:
    """The pods to evict on one node (none: the room frees without evicting anyone), the GPUs the preemptor
    gets once they are gone, and the victims' priorities (``highest``: None with no victim)."""

    pods: tuple[str, ...]
    gpus: tuple[int, ...]
    highest: int | None
    priorities: tuple[int, ...]
    pdb_violations: int = 0


def claims_request(asks: Sequence[ClaimAsk], unit: MemoryUnit) -> PodRequest | str:
    """The pod's pending claims as one pod request (the same memory and compute on each of its devices), or why
    they are not preempted for: devices that take a GPU whole, that differ in size, compute or sharing mode, or
    that must be joined by NVLink across claims (the extender's victims free GPUs, not a linked set)."""
    pieces = parts(asks, unit)
    if not pieces:
        return "the pod has no pending claim of this driver"
    if any(p.units is None for p in pieces):
        return "its claims ask for whole GPUs"
    if len({(p.units, p.compute, p.mps) for p in pieces}) > 1:
        return "its claims ask for devices of different sizes, compute shares or sharing modes"
    count = sum(p.gpus for p in pieces)
    if count > 1 and any(p.linked for p in pieces):
        return "its claims ask for GPUs joined by NVLink"
    first = pieces[0]
    assert first.units is not None
    return PodRequest(
        containers=(ContainerRequest(name="claims", amount=first.units * count, gpus=count),),
        mps=first.mps,
        compute=ComputeShare(request=first.compute) if first.compute else None,
    )


def claim_of(holding: Holding) -> str:
    """The claim UID a claim holding is named by (``<claim UID>/<request>[/<device>]``)."""
    return holding.uid.split("/", 1)[0]


def claim_victims(
    ledger: Ledger,
    request: PodRequest,
    *,
    priority: int,
    claims: Mapping[str, Collection[str]],
    pods: Mapping[str, ClaimPod],
    published: Collection[int],
    pdb_allowed: Mapping[str, int] | None = None,
) -> ClaimVictims | None:
    """The pods to evict from the node of ``ledger`` (its claims' holdings, one per device) so that ``request``
    fits on GPUs of ``published``, or None where no eviction of lower-priority pods does. ``claims``: claim UID
    -> the pods it is reserved for; ``pods``: what each of those pods is (a pod missing holds its claims)."""
    groups = _groups(claims)
    of_claim = {claim: number for number, (members, _) in enumerate(groups) for claim in members}
    by_group: dict[int, list[Holding]] = {}
    fixed: list[Holding] = []
    for holding in ledger.holdings():
        number = of_claim.get(claim_of(holding)) if not holding.kept else None
        if number is None:
            fixed.append(holding)
        else:
            by_group.setdefault(number, []).append(holding)
    occupants: dict[str, Occupant] = {}
    members_of: dict[str, tuple[str, ...]] = {}
    for number, (_, members) in enumerate(groups):
        held = by_group.get(number, [])
        known = [pods.get(uid) for uid in members]
        if not held:
            continue
        if all(pod is not None and pod.terminating for pod in known):
            continue  # going already: counted free
        merged = _one_holding(f"{GROUP_UID}/{number}", held)
        top = max((pod.priority for pod in known if pod is not None), default=priority)
        if merged is None or any(pod is None for pod in known) or top >= priority:
            fixed.extend(held)
            continue
        fixed.append(merged)
        occupants[merged.uid] = Occupant(
            priority=top, pdbs=tuple(sorted({pdb for pod in known if pod is not None for pdb in pod.pdbs}))
        )
        members_of[merged.uid] = tuple(sorted(members))
    inventory = ledger.inventory
    for gpu in inventory.gpus:
        if gpu.index not in published:
            fixed.append(
                Holding(
                    uid=f"{UNPUBLISHED_UID}/{gpu.index}",
                    namespace="",
                    name="",
                    gpus={gpu.index: gpu.memory},
                    compute=100,
                    kept=True,
                )
            )
    found = select_victims(
        Ledger.build(inventory, fixed),
        request,
        priority=priority,
        occupants=occupants,
        pdb_allowed=pdb_allowed or {},
    )
    if found is None:
        return None
    victims = tuple(uid for group in found.uids for uid in members_of[group])
    priorities = tuple(pods[uid].priority for uid in victims)
    return ClaimVictims(victims, found.gpus, found.highest_priority, priorities, found.pdb_violations)


def _groups(claims: Mapping[str, Collection[str]]) -> list[tuple[frozenset[str], frozenset[str]]]:
    """The claims reserved for pods, joined into groups by the pods they share: (claims, pods) each. A claim
    reserved for no pod is in no group."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for claim, reserved in claims.items():
        for pod in reserved:
            parent[root(f"claim:{claim}")] = root(f"pod:{pod}")
    found: dict[str, tuple[set[str], set[str]]] = {}
    for claim, reserved in claims.items():
        if not reserved:
            continue
        members = found.setdefault(root(f"claim:{claim}"), (set(), set()))
        members[0].add(claim)
        members[1].update(reserved)
    return [(frozenset(c), frozenset(p)) for c, p in sorted(found.values(), key=lambda m: sorted(m[0]))]


def _one_holding(uid: str, held: Sequence[Holding]) -> Holding | None:
    """The group's devices as one holding, where one holding holds exactly what they do: the same compute
    share on each of its GPUs, one sharing mode, and at most one MPS client per GPU; else None."""
    units: dict[int, int] = {}
    compute: dict[int, int] = {}
    clients: dict[int, int] = {}
    for holding in held:
        if holding.pending or not holding.gpus:
            return None
        for index, amount in holding.gpus.items():
            units[index] = units.get(index, 0) + amount
            compute[index] = compute.get(index, 0) + holding.compute
            clients[index] = clients.get(index, 0) + 1
    modes = {holding.mps for holding in held}
    if len(modes) != 1 or len(set(compute.values())) != 1:
        return None
    mps = modes.pop()
    if mps and max(clients.values()) > 1:
        return None
    first = held[0]
    return Holding(
        uid=uid,
        namespace=first.namespace,
        name=first.name,
        gpus=units,
        mps=mps,
        assigned=True,
        compute=next(iter(compute.values())),
    )
