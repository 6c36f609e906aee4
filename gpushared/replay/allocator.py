"""The trace's cluster on DRA with gpushared's claim allocator: the "after" beside
``replay.kubescheduler``'s "before".

Each GPU task is a pod with one claim, written as a user writes it (one request of this driver's DeviceClass,
``count`` its GPUs, ``capacity.requests.memory`` its memory on each) and read as the allocator reads it
(``core.placement.claims.asks.read_pending``). The allocator places it with the policy over every node
kube-scheduler's filters pass (CPU, memory, pods, GPU model): ``core.placement.claims.choice`` on each node
and its choice among them, kube-scheduler's own resource scores of the node breaking the policy's ties
(``core.placement.claims.choice.kube_resource_score``, over the CPU and memory the allocator counts on
each node as the extender's cache does), then a draw, as kube-scheduler draws among equal scores.
kube-scheduler then binds the pod to that node (the allocation's node selector).

A task without GPUs has no claim and no gate. Two deployments differ there:

- ``dra-allocator-<policy>``: the allocator runs in the extender's process and kube-scheduler calls the
  extender, whose prioritize keeps CPU-only pods off nodes with idle GPUs (a self-managed cluster);
- ``dra-allocator-only-<policy>``: the allocator alone, no extender verbs (a managed cluster, whose
  kube-scheduler calls no extender): kube-scheduler places CPU-only pods by its default scores
  (``FirstFitCluster``), spreading them over GPU nodes too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from gpushared.contract import dra
from gpushared.core.placement.claims.asks import ClaimAsk, read_pending
from gpushared.core.placement.claims.choice import CandidateNode, ClaimChoice, Setting, choose, place_on
from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.mixbook import ExpectedMix
from gpushared.core.placement.policies import Policy
from gpushared.core.placement.pricing import NodeCpu
from gpushared.core.placement.steering import SteerCandidate, preferred_terms
from gpushared.core.shared.verdicts import idle_gpu_mib
from gpushared.replay.cluster import SimCluster, SimNode
from gpushared.replay.kubescheduler import FirstFitCluster, heap_top
from gpushared.replay.trace import TraceNode, TracePod

#: What this placement is called in the replay's results: ``dra-allocator-<policy>``, and without the
#: extender's verbs ``dra-allocator-only-<policy>``.
PREFIX = "dra-allocator-"
ALONE = "dra-allocator-only-"
#: The allocator alone with the steerer (``--steer-cpu-pods``): each CPU-only pod given a preferred node affinity
#: for the nodes the extender's prioritize-no-gpu ranks best, which kube-scheduler weighs with NodeAffinity's
#: score (weight 2, the preferred nodes scoring 100) beside its own.
STEERED = "dra-allocator-steered-"
#: NodeAffinity's weight among kube-scheduler's default score plugins.
NODE_AFFINITY_WEIGHT = 2


def policy_of(placement: str) -> tuple[str, bool, bool]:
    """(the policy's name, whether the allocator runs without the extender's verbs, whether it steers CPU-only
    pods) of a placement's name."""
    if placement.startswith(ALONE):
        return placement.removeprefix(ALONE), True, False
    if placement.startswith(STEERED):
        return placement.removeprefix(STEERED), True, True
    return placement.removeprefix(PREFIX), False, False


def claim_of(pod: TracePod, *, unit_bytes: int, compute: bool = False) -> dict[str, Any]:
    """The task's claim as a user writes it: its GPUs, each with its memory (and with ``compute`` its share
    as a compute request)."""
    wanted = {dra.CAPACITY_MEMORY: str(pod.memory_per_gpu * unit_bytes)}
    if compute:
        wanted[dra.CAPACITY_COMPUTE] = str(pod.compute_request)
    return {
        "metadata": {"namespace": "replay", "name": pod.name, "uid": pod.name, "resourceVersion": "1"},
        "spec": dra.claim_spec(count=pod.num_gpu, capacity=wanted),
    }


class AllocatorCluster(FirstFitCluster):
    """GPU tasks' claims placed by the claim allocator with ``policy``; other tasks by kube-scheduler."""

    def __init__(
        self,
        nodes: Sequence[TraceNode],
        *,
        policy: Policy,
        mix: RequestMix | None,
        rng: random.Random,
        links: bool = False,
        expected: ExpectedMix | None = None,
        compute: bool = False,
        alone: bool = False,
        steer: bool = False,
    ) -> None:
        """``alone``: no extender verbs, CPU-only pods placed by kube-scheduler's default scores."""
        super().__init__(nodes, mix=mix, rng=rng, links=links, expected=expected, compute=compute, policy=policy)
        self.chosen_policy = policy
        self.alone, self.steer = alone, steer
        if not alone:  # the extender is sent every node kube-scheduler's filters pass, as the published figures
            self.window = 0
        self.index_of = {node.trace.name: i for i, node in enumerate(self.nodes)}
        self.unit_bytes = self.nodes[0].ledger.unit.to_bytes(1) if self.nodes else 1
        #: per node, (need, GPUs, pod CPU, pinned, compute) -> (node version placed at, the placement or None)
        self.placed: list[dict[tuple[int, int, int, bool, int], tuple[int, ClaimChoice | None]]] = [
            {} for _ in self.nodes
        ]
        #: claims the allocator read as something to hand over, or could not read: none should be
        self.handed_over = 0

    def place(self, pod: TracePod) -> bool:
        if not pod.num_gpu:  # no claim: kube-scheduler's own scores, or the extender's prioritize
            if self.steer:
                return self._steered(pod)
            return super().place(pod) if self.alone else SimCluster.place(self, pod)
        if self.allocated_mib >= self._rooms_due and self._recounts:
            self._count_mix()
        ask = read_pending(claim_of(pod, unit_bytes=self.unit_bytes, compute=self.compute))
        if not isinstance(ask, ClaimAsk):
            self.handed_over += 1
            return False
        request = self._request(pod)
        need = request.total
        passing = [(index, node) for index, node in enumerate(self.nodes) if node.gpu_free >= need and node.admits(pod)]
        result = choose(
            [ask],
            passing,
            self.chosen_policy,
            place=lambda candidate: self._place_on(*candidate, ask, pod),
            kube_score=lambda choice: float(self._in_tree(self.nodes[self.index_of[choice.node]], pod)),
            pick=lambda tied: tied[self.rng.randrange(len(tied))],
        )
        if not isinstance(result, ClaimChoice):
            self.gpu_failed += 1
            self.gpu_failed_with_room += any(self._first_fit(i, request) is not None for i in range(len(self.nodes)))
            return False
        index = self.index_of[result.node]
        self.requests[index].add(pod)
        self._bind(self.nodes[index], pod, request, [p.index for p in result.picks])
        return True

    def _steered(self, pod: TracePod) -> bool:
        """A CPU-only pod steered as the extender's steerer does (``core.placement.steering``): the preferred
        terms it is given count in kube-scheduler's own search and scores as NodeAffinity counts them (the sum
        of the terms a node matches, normalized to 100 over the nodes scored, times NODE_AFFINITY_WEIGHT)."""
        candidates = [
            SteerCandidate(name=node.trace.name, idle=float(idle_gpu_mib(node.ledger)))
            for node in self.nodes
            if node.admits(pod)
        ]
        weights = {
            self.index_of[name]: term.weight
            for term in preferred_terms(
                candidates,
                kube_score=lambda name: float(self._in_tree(self.nodes[self.index_of[name]], pod)),
                shuffle=self.rng.shuffle,
            )
            for name in term.nodes
        }
        request = self._request(pod)
        found, processed = self._search(pod, request)
        self.next_start = (self.next_start + processed) % len(self.nodes)
        if not found:
            return False
        affinity = [weights.get(i, 0) for i, _ in found]
        top = max(affinity)  # NodeAffinity's NormalizeScore: the best of the nodes scored gets 100
        scores = [
            self._score(i, pod) + (NODE_AFFINITY_WEIGHT * 100 * a // top if top else 0)
            for (i, _), a in zip(found, affinity, strict=True)
        ]
        index, devices = found[heap_top(scores)]
        self.requests[index].add(pod)
        self._bind(self.nodes[index], pod, request, devices)
        return True

    def _count_mix(self) -> None:
        """A new mix: every node's placements read it, so they are all worked out again."""
        super()._count_mix()
        for known in self.placed:
            known.clear()

    @staticmethod
    def _cpu(node: SimNode) -> NodeCpu:
        return NodeCpu(allocatable=node.trace.cpu_milli, requested=node.trace.cpu_milli - node.cpu_free)

    def _place_on(self, index: int, node: SimNode, ask: ClaimAsk, pod: TracePod) -> ClaimChoice | None:
        """:func:`place_on` for the task's claim on the node, kept until the node or the mix changes."""
        policy = self.chosen_policy
        compute = pod.compute_request if self.compute else 0
        slot = (pod.memory_request, pod.num_gpu, pod.cpu_milli if policy.reads_cpu else 0, bool(pod.models), compute)
        known = self.placed[index].get(slot)
        if known is not None and known[0] == node.version:
            return known[1]
        setting = Setting(
            mix=self.mix, cpu=self._cpu(node), pod_cpu=pod.cpu_milli, model=node.trace.model, pinned=bool(pod.models)
        )
        devices = {gpu.index: dra.device_name(gpu.uuid) for gpu in node.ledger.inventory.gpus}
        candidate = CandidateNode(name=node.trace.name, ledger=node.ledger, devices=devices, setting=setting)
        placed = place_on([ask], candidate, policy)
        self.placed[index][slot] = (node.version, placed)
        return placed
