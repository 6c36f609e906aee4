"""What the extender runs on its event loop besides the verbs, and how it knows the loop is alive.

- the read-backs of binds the watch has not confirmed (``Scheduler.settle_binds``), every SETTLE_SECONDS;
- the loop's heartbeat and lag probe: a timer every LAG_PROBE_SECONDS, how late it ran is how long one
  request held the loop (``gpushared_extender_event_loop_lag_max_seconds``);
- the primer (``priming.Primer``);
- and, on a thread of its own, the :func:`watchdog` that ends a process whose loop stopped beating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from aiohttp import web

from gpushared.extender.http.guard import Ready
from gpushared.extender.metrics import ExtenderMetrics
from gpushared.extender.scheduler import Scheduler

log = logging.getLogger(__name__)

#: A loop that has not run its 20 ms timer for this long is wedged: its Lease is not renewed (a third of
#: the renew deadline, so a follower takes over within one lease duration of the wedge).
LOOP_ALIVE_SECONDS = 3.0
#: How often the loop-lag probe asks to run; how late it runs is how long something held the loop.
LAG_PROBE_SECONDS = 0.02
#: How often the extender reads back binds the watch has not confirmed (``Scheduler.settle_binds``).
SETTLE_SECONDS = 1.0

Background = Callable[[web.Application], AsyncIterator[None]]


class Heartbeat:
    """When the event loop last ran a timer. The verbs, the probes and the Lease all depend on the loop: a
    leader renews its Lease only while this is recent (a loop wedged by a deadlock once kept renewing from
    its election thread, and the follower forwarded every verb to it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()

    def beat(self) -> None:
        self.last = self.clock()

    def alive(self, within: float = LOOP_ALIVE_SECONDS) -> bool:
        return self.clock() - self.last < within


def in_background(name: str, work: Callable[[], Coroutine[Any, Any, None]]) -> Background:
    """``work`` as a task for as long as the app runs (an aiohttp cleanup context)."""

    async def context(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(work(), name=name)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return context


def settling(scheduler: Scheduler) -> Background:
    async def settle_forever() -> None:
        while True:
            try:
                await scheduler.settle_binds()
            except Exception:  # one bad round must not end the reads that release memory
                log.exception("reading binds back failed")
            await asyncio.sleep(SETTLE_SECONDS)

    return in_background("settle-binds", settle_forever)


def watching_the_loop(metrics: ExtenderMetrics, ready: Ready, heartbeat: Heartbeat) -> Background:
    """The loop's heartbeat, and the longest the loop was late to a timer, counted from the first time the
    extender is ready: the first sync holds the interpreter on purpose."""

    async def probe_forever() -> None:
        worst = 0.0
        clock = asyncio.get_running_loop().time
        while not ready()[0]:
            heartbeat.beat()
            await asyncio.sleep(LAG_PROBE_SECONDS)
        while True:
            heartbeat.beat()
            asked = clock()
            await asyncio.sleep(LAG_PROBE_SECONDS)
            lag = clock() - asked - LAG_PROBE_SECONDS
            if lag > worst:
                worst = lag
                metrics.loop_lag.set(worst)

    return in_background("loop-lag", probe_forever)


def watchdog(
    heartbeat: Heartbeat, *, within: float, exit: Callable[[int], None], sleep: Callable[[float], None]
) -> None:
    """The extender's own liveness check, wherever it runs (a pod's livenessProbe on /healthz needs a
    kubelet; a process on a host has none): an event loop that has run no timer for ``within`` seconds is
    wedged (a deadlock, a verb that never returns), and the process exits with status 70, for its
    supervisor (kubelet, systemd) to start it again. Its Lease went to another replica long before."""
    while True:
        sleep(1.0)
        if not heartbeat.alive(within=within):
            log.critical("the event loop has not run for %.0f s: exiting to be started again", within)
            exit(70)
            return
