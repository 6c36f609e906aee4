"""The claim allocator's scenario: one tenant's pods that kube-scheduler never places, beside another tenant's
ordinary pods, counted from the API server's objects."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from faultsuite.harness import Hung, deadline
from gpushared.core.placement.policies import policy_named
from gpushared.extender.claims.allocator import TICK_SECONDS, AllocatorSettings
from tests.claimtenant import TenantCase
from tests.claimworld import ClaimWorld, allocation, consumed_per_device, dra_node, parse
from tests.fakes.apiserver import FakeApiServer

TENANT_SCENARIO = "claim allocator: a tenant's unschedulable ungated pods every 2 s, another's gated pod"
#: The longest an ordinary pod may wait for its claim's allocation beside the tenant's pods.
WITHIN_SECONDS = 2.0


@dataclass
class TenantOutcome:
    scenario: str
    #: each ordinary pod's seconds from its creation to its gate removed with its claim allocated
    waits: list[float] = field(default_factory=list)
    #: ordinary pods not allocated within WITHIN_SECONDS (or never)
    late: list[str] = field(default_factory=list)
    #: GPUs whose claims, as the API server holds them, consume more than the GPU has
    over_capacity: list[str] = field(default_factory=list)
    tenant_pods: int = 0
    #: allocations the fence held back (the allocator's count)
    fenced: int = 0
    hung: bool = False
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (self.late or self.over_capacity or self.hung)

    def summary(self) -> str:
        """The suite's lines for it: what it measured, then each problem."""
        waits = ", ".join(f"{wait:.2f}" for wait in self.waits) or "none"
        line = (
            f"{self.scenario}: ordinary pods allocated after {waits} s (pass: {WITHIN_SECONDS:g} s); "
            f"{self.tenant_pods} tenant pods; allocations the fence held back {self.fenced}; GPUs over capacity: "
            f"{len(self.over_capacity)}; {self.seconds} s" + ("  HUNG" if self.hung else "")
        )
        return "\n".join([line, *(f"    {problem}" for problem in (self.late + self.over_capacity)[:8])])


def run_tenant_within(args: argparse.Namespace, work: Path) -> TenantOutcome:
    outcome = TenantOutcome(scenario=TENANT_SCENARIO)
    started = time.monotonic()
    try:
        with deadline(args.deadline):
            run_tenant(args, outcome)
    except Hung:
        outcome.hung = True
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


def run_tenant(args: argparse.Namespace, outcome: TenantOutcome) -> None:
    """DRA nodes of 1-4 GPUs of 8, 16 or 24 GiB (a tenth of ``--nodes``, at least 2) and the leader's claim
    allocator on the wall clock (tests/claimtenant.py). The tenant creates, every 2 s, a pod without the
    gate with a 1 GiB claim, which kube-scheduler never places and whose claim fits every GPU: in turn, a
    node selector no node matches (the allocator reads it) and a required pod affinity no pod satisfies
    (the fence does not model it, so it keeps the pod's room on every GPU). From 5 s on, three ordinary gated
    pods with a 4 GiB claim, 2.5 s apart; each must be allocated within WITHIN_SECONDS. Then no GPU may hold
    claims past its memory or compute."""
    rng = random.Random(args.seed)
    with FakeApiServer() as api:
        for number in range(max(2, args.nodes // 10)):
            dra_node(api, f"dra-{number:03d}", *[rng.choice((8, 16, 24)) for _ in range(rng.randint(1, 4))])

        async def main() -> None:
            world = ClaimWorld(api, AllocatorSettings(policy=policy_named("fgd")))
            await world.start()
            try:
                case = TenantCase(
                    api, world, clock=time.monotonic, tick=lambda: asyncio.sleep(TICK_SECONDS), lead=5.0, spacing=2.5
                )
                case.ordinary, case.give_up, case.reasons = 3, 10.0, ("selector", "affinity")
                await case.run()
                outcome.waits = [round(wait, 3) for wait in case.waits]
                outcome.tenant_pods, outcome.fenced = case.tenant_pods, world.allocator.counts["fenced"]
            finally:
                await world.stop()

        asyncio.run(main())
        outcome.late = [
            f"ordinary-{number}: {'never allocated' if wait == float('inf') else f'allocated after {wait:.2f} s'}"
            for number, wait in enumerate(outcome.waits)
            if wait > WITHIN_SECONDS or not allocation(api, f"ordinary-{number}")
        ]
        capacities = {
            (s["spec"]["nodeName"], d["name"]): {k: parse(v["value"]) for k, v in d["capacity"].items()}
            for s in api.objects("resourceslices")
            for d in s["spec"]["devices"]
        }
        outcome.over_capacity = [
            f"{node} {device}: {name} {amount} of {capacities[(node, device)][name]}"
            for (node, device), counted in consumed_per_device(api.objects("resourceclaims")).items()
            for name, amount in counted.items()
            if amount > capacities[(node, device)][name]
        ]
