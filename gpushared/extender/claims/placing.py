"""Where the claim allocator puts a gated pod's claims now: the nodes it may go to, and on each the
placement ``core.placement.claims.choice`` works out, kept until something it read changes.

The candidates are the nodes whose ResourceSlices publish this driver's GPUs and that kube-scheduler's
filters would pass as far as the extender counts them: the pod's CPU and memory requests fit, and its node
selection allows the node's GPU model. Each node's placement for a kind of ask (its requests' names, counts,
memory and compute, MPS, NVLink) is kept until the node's ledger of claims, its CPU or the request mix
changes: a burst of a thousand pods alike prices each node once per change, not once per pod (the
extender's filter index keeps its ranks the same way).

While kube-scheduler may be allocating claims of pods it was given, a gated pod is placed on each node's
ledger with the room kept for them counted (``core.placement.claims.room``, worked out by
``extender.claims.fence``). And a pod that found no room finds none until something a placement reads changes:
once a step (``look``) the placer sees whether anything did, and until then the pods of a kind that found no
room are not priced again: two thousand pods waiting for room cost a step a lookup each, not a pricing.
"""

from __future__ import annotations

import json
import random
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

from gpushared.contract import GpuInventory, dra
from gpushared.core.dra.slices import nvlink_domains
from gpushared.core.placement.claims.asks import ClaimAsk
from gpushared.core.placement.claims.choice import (
    CandidateNode,
    ClaimChoice,
    NoRoom,
    Resources,
    Setting,
    choose,
    kube_resource_score,
    place_on,
)
from gpushared.core.placement.claims.room import NO_ROOM_KEPT, KeptRoom, Room, added, with_kept
from gpushared.core.placement.cpu import cpu_of, memory_request
from gpushared.core.placement.nodefit import admits, within_bounds
from gpushared.core.placement.nodes import NodeState
from gpushared.core.placement.policies import Policy
from gpushared.core.shared.bodies import PodBody, gpu_models
from gpushared.core.shared.ledger import Ledger
from gpushared.extender.cache import ClusterCache
from gpushared.extender.claims.cache import ClaimCache

#: A pod with no node selection and no toleration, as ``nodefit.admits`` reads it.
NO_SELECTION: PodBody = {"spec": {}}
#: Placements kept at most; past it they are all worked out again (a bound on any mix of ask kinds).
MAX_KEPT = 100_000
#: The most text of pods' node selections kept at once: a tenant's pods may each carry a large one (a pod may
#: be 1.5 MiB), and pods gone must not keep theirs; past it they are all read again.
MAX_SELECTION_BYTES = 16 * 2**20


class PodAsk(NamedTuple):
    """What a placement reads of a pod: its pending claims' shape, its CPU (milli) and memory requests, the GPU
    models its node selection allows (None: any), the node an allocated claim of it fixes (None: any), and its
    node selection (``selection_of``: its nodeSelector, required node affinity and tolerations)."""

    shape: tuple[Any, ...]
    cpu: int
    memory: int
    models: frozenset[str] | None
    fixed: str | None
    selection: str = ""


#: The part of a pod's node affinity kube-scheduler filters nodes by.
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def selection_of(pod: PodBody) -> str:
    """The pod's node selection as one comparable text ("": none), in the shape of a pod's spec (only the
    required part of its node affinity): pods alike in it are admitted alike."""
    spec: Mapping[str, Any] = pod.get("spec") or {}
    chosen = {key: spec[key] for key in ("nodeSelector", "tolerations") if spec.get(key)}
    affinity = spec.get("affinity")
    required = ((affinity or {}).get("nodeAffinity") or {}) if isinstance(affinity, Mapping) else {}
    if isinstance(required, Mapping) and required.get(REQUIRED) is not None:
        chosen["affinity"] = {"nodeAffinity": {REQUIRED: required[REQUIRED]}}
    return json.dumps(chosen, sort_keys=True, separators=(",", ":")) if chosen else ""


class ClaimPlacer:
    def __init__(
        self, cache: ClusterCache, claim_cache: ClaimCache, policy: Policy, *, model_label: str, rng: random.Random
    ) -> None:
        self.cache, self.claim_cache, self.policy = cache, claim_cache, policy
        self.model_label, self.rng = model_label, rng
        #: (node, kind of ask) -> (the ledger priced, weakly: a ledger gone never matches one made since; what
        #: else the placement read; the placement or None)
        self._placements: dict[tuple[str, Any], tuple[weakref.ref[Ledger], Any, ClaimChoice | None]] = {}
        #: node -> (its inventory and published devices, as last seen: compared by identity, the GPUs given
        #: out and their NVLink domains worked out from them)
        self._static: dict[str, tuple[GpuInventory, frozenset[str], Mapping[int, str], Mapping[int, str]]] = {}
        #: the room kept for kube-scheduler this step (``look``), counted for the pods placed ``fenced``
        self.kept: KeptRoom = NO_ROOM_KEPT
        #: node -> (its ledger and version, the room kept, the ledger with that room counted), while the same
        self._with_kept: dict[str, tuple[Ledger, int, Mapping[int, Room], Ledger]] = {}
        #: what every placement read at the last ``look`` (the objects it names kept alive, so that no object
        #: made since has the same id), and how many times that changed
        self._world: list[Any] = []
        self._alive: list[Any] = []
        self.generation = 0
        #: (what a placement reads of a pod, fenced, the room held for others) -> why pods of that kind found no
        #: room this generation
        self._no_room: dict[tuple[PodAsk, bool, Any], NoRoom] = {}
        #: pricings of a pod (its kind's placement on every candidate), for the tests' count of the work
        self.pricings = 0
        #: a pod's node selection (``selection_of``) -> the part of its spec ``nodefit.admits`` reads
        self._selections: dict[str, PodBody] = {}
        self._selection_bytes = 0

    def look(self, kept: KeptRoom) -> None:
        """Once a step, before its placements: the room kept for kube-scheduler (``kept``), and whether anything
        a placement reads changed since the last step: the nodes published, each one's ledger, CPU, memory,
        model and GPUs, the request mix, the room kept. When nothing did, a kind of pod that found no room
        finds none now. Within a step the allocator's own choices only take room."""
        state = self.cache.state
        published = self.claim_cache.published()
        mix = state.mix_generation if self.policy.reads_mix or self.policy.reads_pressure else 0
        alive: list[Any] = [published, kept]
        world: list[Any] = [id(published), id(kept), mix]
        for name, node, inventory, _ in self._nodes():
            ledger = self.claim_cache.ledger(name, inventory)
            alive.append(ledger)
            cpu_and_memory = (node.cpu_version, node.memory_allocatable, node.memory_requested)
            world.append((name, id(ledger), ledger.version, *cpu_and_memory, node.model, inventory, node.facts))
        if world != self._world:
            self._world, self.generation = world, self.generation + 1
            self._no_room.clear()
        if not kept:
            self._with_kept.clear()
        self._alive, self.kept = alive, kept

    def ask_of(self, pod: PodBody, asks: Sequence[ClaimAsk], fixed: str | None) -> PodAsk:
        shape = tuple(
            (a.mps, a.linked, tuple((r.request, r.count, r.memory, r.compute) for r in a.requests)) for a in asks
        )
        selection = selection_of(pod)
        if selection and selection not in self._selections:
            if self._selection_bytes + len(selection) > MAX_SELECTION_BYTES:
                self._selections.clear()  # read again from the pods that still wait, as they are decided
                self._selection_bytes = 0
            self._selections[selection] = cast(PodBody, {"spec": json.loads(selection)})
            self._selection_bytes += len(selection)
        return PodAsk(shape, cpu_of(pod), memory_request(pod), gpu_models(pod, self.model_label), fixed, selection)

    def choose(
        self,
        pod: PodBody,
        asks: Sequence[ClaimAsk],
        fixed: str | None,
        *,
        fenced: bool = False,
        held: KeptRoom = NO_ROOM_KEPT,
    ) -> ClaimChoice | NoRoom:
        """The best node for the pod's claims (``fixed``: the one an allocated claim of the pod is on); with the
        room kept for kube-scheduler (``look``) counted where ``fenced``, and the room ``held`` for
        preemptors the pod must leave alone (``claims.preempting``). A kind of pod that found no room since
        the last change ``look`` saw is told so again without being priced."""
        ask = self.ask_of(pod, asks, fixed)
        seen = (ask, fenced, _key_of(held))
        known = self._no_room.get(seen)
        if known is not None:
            return known
        choice = self._choose(ask, asks, kept=added(self.kept if fenced else NO_ROOM_KEPT, held))
        if isinstance(choice, NoRoom) and self.generation:
            self._no_room[seen] = choice
        return choice

    def _choose(self, ask: PodAsk, asks: Sequence[ClaimAsk], *, kept: KeptRoom) -> ClaimChoice | NoRoom:
        self.pricings += 1
        candidates = self.candidates(ask, kept=kept)
        kind = (ask.shape, ask.cpu if self.policy.reads_cpu else 0, ask.models is not None)
        mix = self.cache.state.mix_generation if self.policy.reads_mix or self.policy.reads_pressure else 0
        return choose(
            asks,
            candidates,
            self.policy,
            place=lambda candidate: self._placed(candidate, asks, kind, mix),
            pick=lambda tied: tied[self.rng.randrange(len(tied))],
        )

    def _placed(self, candidate: CandidateNode, asks: Sequence[ClaimAsk], kind: Any, mix: int) -> ClaimChoice | None:
        node = self.cache.state.nodes[candidate.name]
        ledger = candidate.ledger
        stamp = (ledger.version, node.cpu_version, mix, len(candidate.devices))
        key = (candidate.name, kind)
        known = self._placements.get(key)
        if known is not None and known[0]() is ledger and known[1] == stamp:
            return known[2]
        placed = place_on(asks, candidate, self.policy)
        if len(self._placements) >= MAX_KEPT:
            self._placements.clear()
        self._placements[key] = (weakref.ref(ledger), stamp, placed)
        return placed

    def candidates(self, ask: PodAsk, *, kept: KeptRoom = NO_ROOM_KEPT) -> list[CandidateNode]:
        """The nodes publishing this driver's GPUs that kube-scheduler's filters would pass for the pod as far
        as the extender counts them (``admits``), each with its ledger of claims, the allocator's writes the
        watch does not show yet counted, and the room ``kept`` on the node's GPUs."""
        mix = self.cache.state.request_mix() if self.policy.reads_mix or self.policy.reads_pressure else None
        found = []
        for name, node, inventory, devices in self._nodes():
            if not self.admits(node, ask):
                continue
            cpu, memory = node.cpu, node.memory_allocatable
            given, domains = self._given(name, inventory, devices)
            resources = None
            if cpu is not None and memory is not None:
                resources = Resources(cpu.allocatable, cpu.requested, memory, node.memory_requested)
            ledger = self.claim_cache.ledger(name, inventory)
            room = kept.get(name)
            found.append(
                CandidateNode(
                    name=name,
                    ledger=self._kept_on(name, ledger, room) if room else ledger,
                    devices=given,
                    domains=domains,
                    setting=Setting(mix=mix, cpu=cpu, pod_cpu=ask.cpu, model=node.model, pinned=ask.models is not None),
                    kube_score=kube_resource_score(resources, pod_cpu=ask.cpu, pod_memory=ask.memory),
                )
            )
        return found

    def shown(self) -> Iterator[tuple[str, NodeState, Ledger, Mapping[int, str]]]:
        """The nodes claims may be allocated on as kube-scheduler may see them: the claims the watch shows,
        without the allocator's writes it does not show yet (kube-scheduler's own watch may not show them
        either), and the GPUs their slices publish."""
        for name, node, inventory, devices in self._nodes():
            yield (
                name,
                node,
                self.claim_cache.ledger(name, inventory, assumed=False),
                self._given(name, inventory, devices)[0],
            )

    def admits(self, node: NodeState, ask: PodAsk, *, generous: bool = False) -> bool:
        """Whether kube-scheduler's filters would pass the node for the pod as far as the extender counts them:
        its node selection and tolerations let it onto the node's labels, taints and cordon (``nodefit``), its
        CPU and memory requests fit, its node selection allows the node's GPU model, and no allocated claim of
        the pod fixes another node. A claim allocated where its pod cannot go would hold the GPU's room for as
        long as the pod exists, and the pod would never be bound. ``generous`` (the fence, which must count
        every node kube-scheduler may place the pod on): a node selection too large to read whole admits."""
        if ask.fixed is not None and node.name != ask.fixed:
            return False
        selection = self._selections.get(ask.selection, NO_SELECTION)
        if node.facts is not None and not admits(node.facts, selection) and (not generous or within_bounds(selection)):
            return False
        cpu, memory = node.cpu, node.memory_allocatable
        if cpu is not None and cpu.requested + ask.cpu > cpu.allocatable:
            return False
        if memory is not None and node.memory_requested + ask.memory > memory:
            return False
        return ask.models is None or node.model in ask.models

    def _nodes(self) -> Iterator[tuple[str, NodeState, GpuInventory, frozenset[str]]]:
        """The nodes publishing this driver's GPUs whose inventory the extender reads, with their devices."""
        nodes = self.cache.state.nodes
        for name, devices in self.claim_cache.published().items():
            node = nodes.get(name)
            if node is not None and node.inventory is not None and not node.problem:
                yield name, node, node.inventory, devices

    def _kept_on(self, name: str, ledger: Ledger, room: Mapping[int, Room]) -> Ledger:
        """The node's ledger with the room kept for kube-scheduler counted, the same object while neither
        changes (its placements are kept by it)."""
        known = self._with_kept.get(name)
        if known is not None and known[0] is ledger and known[1] == ledger.version and known[2] == room:
            return known[3]
        made = with_kept(ledger, room)
        self._with_kept[name] = (ledger, ledger.version, room, made)
        return made

    def _given(
        self, name: str, inventory: GpuInventory, devices: frozenset[str]
    ) -> tuple[Mapping[int, str], Mapping[int, str]]:
        """The node's GPUs its slices publish (index -> device) and their NVLink domains, kept while the node's
        inventory and slices are the same objects."""
        known = self._static.get(name)
        if known is not None and known[0] is inventory and known[1] is devices:
            return known[2], known[3]
        names = {gpu.index: dra.device_name(gpu.uuid) for gpu in inventory.gpus}
        given = {index: device for index, device in names.items() if device in devices}
        domains = nvlink_domains(inventory)
        self._static[name] = (inventory, devices, given, domains)
        return given, domains


def _key_of(room: KeptRoom) -> tuple[tuple[str, int, Room], ...]:
    """Room kept, as a key: equal rooms, equal keys."""
    return tuple(sorted((node, index, kept) for node, on_node in room.items() for index, kept in on_node.items()))
