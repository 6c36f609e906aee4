"""Small builders for placement's tables: one-container requests, GPUs used by hand, a node's rank."""

from __future__ import annotations

from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.policies import BINPACK, NodeRank, Policy
from gpushared.core.placement.pricing import PricingContext
from gpushared.core.shared.ledger import Holding, Ledger
from gpushared.core.shared.requests import ContainerRequest, PodRequest
from gpushared.core.shared.verdicts import judge
from tests.builders import inventory


def request(amount: int, *, mps: bool = False) -> PodRequest:
    return PodRequest(containers=(ContainerRequest("c0", amount),), mps=mps)


#: Binpack and spread read nothing of the node's setting but the verdicts.
PLAIN = PricingContext(Ledger.build(inventory(16)))


def used(ledger: Ledger, index: int, amount: int, *, mps: bool = False) -> None:
    ledger.add(Holding(uid=f"u{index}-{amount}-{mps}", namespace="d", name="x", gpus={index: amount}, mps=mps))


def appraised(
    ledger: Ledger, req: PodRequest, setting: PricingContext | None = None, policy: Policy = BINPACK
) -> NodeRank | None:
    found = policy.price_node(judge(ledger, req), req, setting or PricingContext(ledger))
    return None if found is None else found[0]


def mix_of(*kinds: tuple[int, int]) -> RequestMix:
    """A mix of one-GPU and CPU-only kinds, given as (milli-CPU, size)."""
    return RequestMix((cpu, size, 1 if size else 0) for cpu, size in kinds)


def gang(per_gpu: int, gpus: int) -> PodRequest:
    return PodRequest(containers=(ContainerRequest("c0", per_gpu * gpus, gpus=gpus),))
