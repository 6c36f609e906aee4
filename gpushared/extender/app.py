"""The extender, wired: the cache and its informers, the scheduler, the HTTP app, leader election, and the
run until SIGTERM. ``cli/extender.py`` parses options into an :class:`ExtenderSettings` and calls
:func:`run`; everything the process does from there is here, as the daemon's is in ``daemon/service.py``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvloop

from gpushared.contract import ResourceNames
from gpushared.core.policies import Policy
from gpushared.extender.cache import ClusterCache
from gpushared.extender.config import ServerConfig
from gpushared.extender.priming import Primer
from gpushared.extender.scheduler import Scheduler
from gpushared.extender.server import Heartbeat, build_app, serve
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.api import Api
from gpushared.kube.lease import LeaderElector

log = logging.getLogger("gpushared.extender")

#: How long the startup thread waits for the first sync; a cache that never syncs never serves either.
SYNC_WAIT_SECONDS = 24 * 3600.0


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str
    #: this replica's name in the Lease; its URL is appended, so followers know where to forward verbs
    identity: str
    seconds: float


@dataclass(frozen=True)
class ExtenderSettings:
    server: ServerConfig
    policy: Policy
    resources: ResourceNames
    #: None: no election, this replica serves every verb
    lease: LeaseSettings | None
    #: where the other replica reaches this one (default: the listen address)
    advertise_address: str | None
    watch_seconds: int
    binding_landing_seconds: float
    #: the node label naming GPU models, for fgd's model-aware request mix ("": not weighed)
    model_label: str = ""
    #: filter keeps only the best-ranked nodes, so kube-scheduler wired without prioritizeVerb (deploy/,
    #: Aliyun's wiring) makes the policy's choice; False: every node that fits passes
    rank_in_filter: bool = True

    @property
    def own_url(self) -> str:
        scheme = "https" if self.server.tls_cert else "http"
        return f"{scheme}://{self.advertise_address or self.server.address}:{self.server.port}"


#: An event loop that has run no timer for this long is wedged: the process exits (``_watch_the_loop``).
WEDGED_SECONDS = 60.0


class Extender:
    """One replica: ready once its cache has synced, serving verbs while it leads (or when not electing)."""

    def __init__(self, settings: ExtenderSettings, *, api: Api, binder: AsyncApi) -> None:
        self.settings = settings
        self.cache = ClusterCache(
            list_nodes=api.rest.lister("/api/v1/nodes", what="nodes"),
            list_pods=api.rest.lister("/api/v1/pods", what="pods"),
            resources=settings.resources,
            watch_seconds=settings.watch_seconds,
            landing_seconds=settings.binding_landing_seconds,
            model_label=settings.model_label,
            rooms=settings.policy.reads_rooms,
        )
        lease = settings.lease
        self.heartbeat = Heartbeat()
        self.elector = (
            LeaderElector(
                api.rest,
                namespace=lease.namespace,
                name=lease.name,
                identity=f"{lease.identity} {settings.own_url}",
                lease_seconds=lease.seconds,
                renew_deadline=lease.seconds * 2 / 3,
                retry_seconds=lease.seconds / 7.5,
                alive=self.heartbeat.alive,
                on_lead=self._took_the_lease,
            )
            if lease is not None
            else None
        )
        self.prepared = threading.Event()
        scheduler = Scheduler(
            cache=self.cache,
            api=binder,
            policy=settings.policy,
            resources=settings.resources,
            rank_in_filter=settings.rank_in_filter,
            may_bind=lambda: self.leader() is None,
        )
        primer = Primer(scheduler, ready=lambda: self.ready()[0])
        self.cache.pending_seen = primer.offer
        self.app = build_app(
            scheduler, settings.server, ready=self.ready, leader=self.leader, primer=primer, heartbeat=self.heartbeat
        )

    def ready(self) -> tuple[bool, str]:
        if not self.prepared.is_set():
            return False, "the cache has not synced with the API server yet"
        return True, ""

    def _took_the_lease(self) -> None:
        """A new leader binds nothing its predecessor may still have in flight (``reservations.fenced``).
        Before the first sync there is nothing to read: the fence is armed when the cache is ready."""
        if self.prepared.is_set():
            self.cache.arm_fence()

    def leader(self) -> str | None:
        """Serve here when leading (or not electing); else the leader's URL, from its Lease identity."""
        if self.elector is None or self.elector.leading:
            return None
        holder = self.elector.holder.rsplit(" ", 1)
        return holder[1] if len(holder) == 2 and holder[1].startswith(("http://", "https://")) else ""

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT."""
        self.cache.start()
        threading.Thread(target=self._prepare_when_synced, name="prepare", daemon=True).start()
        threading.Thread(target=self._watch_the_loop, name="liveness", daemon=True).start()
        if self.elector is not None:
            self.elector.start()

        async def serving() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
            await serve(self.app, self.settings.server, stop=stop)

        try:
            uvloop.run(serving())  # cheaper loop turns: docs/benchmarks.md, "What changed, second pass"
        finally:
            if self.elector is not None:
                self.elector.stop()
            self.cache.stop()

    def _watch_the_loop(self) -> None:
        watchdog(self.heartbeat, within=WEDGED_SECONDS, exit=_exit, sleep=time.sleep)

    def _prepare_when_synced(self) -> None:
        """Once the first sync is done: warm the cache, keep what it holds out of the garbage collector's
        walks, and only then say ready.

        Cached pods live as long as their pods do, and 150k of them are about a million tracked objects:
        every full collection would walk them all, a pause in the middle of some filter. Frozen, they are
        still freed by reference counting when the watch drops them (they hold no cycles)."""
        cache = self.cache
        if cache.nodes.wait_synced(SYNC_WAIT_SECONDS) and cache.pods.wait_synced(SYNC_WAIT_SECONDS):
            cache.warm()
            cache.arm_fence()  # a process killed before this one may have left Bindings in flight
            gc.freeze()
            log.info("cache synced; %d objects kept out of the garbage collector's walks", gc.get_freeze_count())
            self.prepared.set()


def run(settings: ExtenderSettings, *, api: Api, binder: AsyncApi) -> None:
    Extender(settings, api=api, binder=binder).run()


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


def _exit(status: int) -> None:
    logging.shutdown()
    os._exit(status)
