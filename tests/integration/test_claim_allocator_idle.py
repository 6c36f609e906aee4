"""Pods that wait for room never keep the allocator's loop busy: once a whole turn of the gated pods started
no write, the loop waits a tick before the next step (``ClaimAllocator.run``)."""

from __future__ import annotations

import asyncio

from gpushared.core.placement.policies import BINPACK
from gpushared.extender.claims import allocator as allocator_module
from gpushared.extender.claims.allocator import AllocatorSettings
from tests.claimworld import ClaimWorld, claim, dra_node, gated_pod
from tests.fakes.apiserver import FakeApiServer


def test_a_turn_that_starts_nothing_lets_the_loop_wait_a_tick() -> None:
    with FakeApiServer() as api:
        dra_node(api, "n1", 16)
        world = ClaimWorld(api, AllocatorSettings(policy=BINPACK))
        sleeps: list[float] = []

        async def main() -> None:
            allocator = await world.start()
            for number in range(10):
                api.create(claim(f"huge{number}", memory="32Gi"))
                api.create(gated_pod(f"p{number}", f"huge{number}"))
            while len(allocator.cache.claiming) < 10 or len(allocator.claim_cache.claims.get("default", {})) < 10:
                await asyncio.sleep(0.02)
            real_sleep = asyncio.sleep

            async def counted(seconds: float) -> None:
                sleeps.append(seconds)
                if len(sleeps) >= 80:
                    raise asyncio.CancelledError
                await real_sleep(0)

            step_seconds = allocator_module.STEP_SECONDS
            # a step decides about one pod: a turn through the ten takes several steps
            allocator_module.STEP_SECONDS = 1e-6
            allocator_module.asyncio.sleep = counted  # type: ignore[assignment]
            try:
                await allocator.run(leading=lambda: True, ready=lambda: True)
            except asyncio.CancelledError:
                pass
            finally:
                allocator_module.asyncio.sleep = real_sleep
                allocator_module.STEP_SECONDS = step_seconds
            await world.stop()

        asyncio.run(main())
    # Each turn through the ten waiting pods takes several steps; between turns the loop waits a tick (before:
    # never, while any pod was left undecided).
    assert sleeps.count(allocator_module.TICK_SECONDS) >= 3, sleeps
    assert sleeps.count(0) >= 10, sleeps
