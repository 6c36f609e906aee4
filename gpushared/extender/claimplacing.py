"""Where the claim allocator puts a gated pod's claims now (issue #54): the nodes it may go to, and on each the
placement ``core.placement.claimchoice`` works out, kept until something it read changes.

The candidates are the nodes whose ResourceSlices publish this driver's GPUs and that kube-scheduler's
filters would pass as far as the extender counts them: the pod's CPU and memory requests fit, and its node
selection allows the node's GPU model. Each node's placement for a kind of ask (its requests' names, counts,
memory and compute, MPS, NVLink) is kept until the node's ledger of claims, its CPU or the request mix
changes: a burst of a thousand pods alike prices each node once per change, not once per pod (the
extender's filter index keeps its ranks the same way).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from gpushared.contract import GpuInventory, dra
from gpushared.core.dra.slices import nvlink_domains
from gpushared.core.placement.claimchoice import (
    Candidate,
    ClaimChoice,
    NoRoom,
    Resources,
    Setting,
    best_of,
    may_fit,
    place_on,
    preference,
)
from gpushared.core.placement.claims import ClaimAsk
from gpushared.core.placement.cpu import cpu_of, memory_request
from gpushared.core.placement.policies import Policy
from gpushared.core.shared.bodies import PodBody, gpu_models
from gpushared.extender.cache import ClusterCache
from gpushared.extender.claimbook import ClaimBook

#: Placements kept at most; past it they are all worked out again (a bound on any mix of ask kinds).
MAX_KEPT = 100_000


class ClaimPlacer:
    def __init__(
        self, cache: ClusterCache, book: ClaimBook, policy: Policy, *, model_label: str, rng: random.Random
    ) -> None:
        self.cache, self.book, self.policy = cache, book, policy
        self.model_label, self.rng = model_label, rng
        #: (node, kind of ask) -> (what the placement read, the placement or None)
        self._kept: dict[tuple[str, Any], tuple[Any, ClaimChoice | None]] = {}
        #: node -> (its inventory and published devices, as last seen: compared by identity, the GPUs given
        #: out and their NVLink domains worked out from them)
        self._static: dict[str, tuple[GpuInventory, frozenset[str], Mapping[int, str], Mapping[int, str]]] = {}

    def choose(
        self, pod: PodBody, asks: Sequence[ClaimAsk], fixed: str | None, *, held: frozenset[str] = frozenset()
    ) -> ClaimChoice | NoRoom:
        """The best node for the pod's claims (``fixed``: the one an allocated claim of the pod is on), none of
        ``held``."""
        candidates = [c for c in self.candidates(pod, fixed) if c.name not in held]
        if not candidates:
            return NoRoom("no node publishes this driver's GPUs and passes the pod's CPU, memory and node selection")
        pinned = gpu_models(pod, self.model_label) is not None
        kind = (
            tuple(
                (a.mps, a.linked, tuple((r.request, r.count, r.memory, r.compute) for r in a.requests)) for a in asks
            ),
            cpu_of(pod) if self.policy.reads_cpu else 0,
            pinned,
        )
        mix = self.cache.state.mix_generation if self.policy.reads_mix or self.policy.reads_pressure else 0
        by_name = {c.name: c for c in candidates}
        placed = [self._placed(candidate, asks, kind, mix) for candidate in candidates]
        return best_of(
            asks,
            placed,
            preference=lambda choice: by_name[choice.node].preference,
            pick=lambda tied: tied[self.rng.randrange(len(tied))],
        )

    def _placed(self, candidate: Candidate, asks: Sequence[ClaimAsk], kind: Any, mix: int) -> ClaimChoice | None:
        node = self.cache.state.nodes[candidate.name]
        stamp = (id(candidate.ledger), candidate.ledger.version, node.cpu_version, mix, len(candidate.devices))
        key = (candidate.name, kind)
        known = self._kept.get(key)
        if known is not None and known[0] == stamp:
            return known[1]
        placed = place_on(asks, candidate, self.policy)
        if len(self._kept) >= MAX_KEPT:
            self._kept.clear()
        self._kept[key] = (stamp, placed)
        return placed

    def fitting(self, pod: PodBody, asks: Sequence[ClaimAsk], fixed: str | None) -> set[str]:
        """The nodes where the pod's claims could be allocated as kube-scheduler may see them: the claims the
        watch shows, without the allocator's writes it does not show yet (kube-scheduler's own watch may not
        show them either), and the pod's CPU, memory and node selection passing there."""
        return {c.name for c in self.candidates(pod, fixed, shown=True) if may_fit(asks, c.ledger, c.devices)}

    def candidates(self, pod: PodBody, fixed: str | None, *, shown: bool = False) -> list[Candidate]:
        """The nodes publishing this driver's GPUs that kube-scheduler's filters would pass for the pod as far
        as the extender counts them (CPU, memory, GPU model), each with its ledger of claims (``shown``: only
        those the watch shows)."""
        pod_cpu, pod_memory = cpu_of(pod), memory_request(pod)
        models = gpu_models(pod, self.model_label)
        mix = self.cache.state.request_mix() if self.policy.reads_mix or self.policy.reads_pressure else None
        found = []
        for name, devices in self.book.published().items():
            node = self.cache.state.nodes.get(name)
            if (fixed is not None and name != fixed) or node is None or node.inventory is None or node.problem:
                continue
            cpu, memory = node.cpu, node.memory_allocatable
            if cpu is not None and cpu.requested + pod_cpu > cpu.allocatable:
                continue
            if memory is not None and node.memory_requested + pod_memory > memory:
                continue
            if models is not None and node.model not in models:
                continue
            inventory = node.inventory
            given, domains = self._given(name, inventory, devices)
            resources = None
            if cpu is not None and memory is not None:
                resources = Resources(cpu.allocatable, cpu.requested, memory, node.memory_requested)
            found.append(
                Candidate(
                    name=name,
                    ledger=self.book.ledger(name, inventory, assumed=not shown),
                    devices=given,
                    domains=domains,
                    setting=Setting(mix=mix, cpu=cpu, pod_cpu=pod_cpu, model=node.model, pinned=models is not None),
                    preference=preference(resources, pod_cpu=pod_cpu, pod_memory=pod_memory),
                )
            )
        return found

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
