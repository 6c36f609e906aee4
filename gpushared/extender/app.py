"""The extender, wired: the cache and its informers, the scheduler, the routes and their transport, leader
election, and the run until SIGTERM. ``cli/extender.py`` parses options into an :class:`ExtenderSettings`
and calls :func:`run`; everything the process does from there is here, as the daemon's is in
``daemon/service.py``.

The event loop's thread owns the cluster state (``cache.ClusterCache``): it claims it before anything
starts, the informers' changes reach it through the cache's inbox, and the one thing another thread tells
it (the election thread: this replica took the Lease) is handed over with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import uvloop
from aiohttp import web

from gpushared.contract import ResourceNames
from gpushared.core.placement.admission import GPUSHARED_SCHEDULER
from gpushared.core.placement.mixbook import ExpectedMix
from gpushared.core.placement.policies import Policy
from gpushared.core.placement.reservations import fence_window
from gpushared.extender.cache import ClusterCache
from gpushared.extender.claims.allocator import AllocatorSettings, ClaimAllocator, claim_events
from gpushared.extender.claims.cache import ClaimCache
from gpushared.extender.events import pod_events
from gpushared.extender.evictioncap import MAX_EVICTIONS_PER_MINUTE
from gpushared.extender.evictions import Evictor
from gpushared.extender.http.config import ServerConfig
from gpushared.extender.http.guard import Guard
from gpushared.extender.http.server import application, serve
from gpushared.extender.http.tls import ServingTls
from gpushared.extender.metrics import ExtenderMetrics
from gpushared.extender.mixing import MixTaker
from gpushared.extender.preempting import Preempter
from gpushared.extender.priming import Primer
from gpushared.extender.routes import Routes
from gpushared.extender.scheduler import Scheduler
from gpushared.extender.steering import Steerer, idle_ledger
from gpushared.extender.tasks import Heartbeat, in_background, settling, watchdog, watching_the_loop
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.api import Api
from gpushared.kube.lease import LeaderElector

log = logging.getLogger("gpushared.extender")

#: How long the start waits for the API server's ``/version`` (the fence's window depends on it).
VERSION_READ_SECONDS = 2.0
#: Who writes the extender's own Events (preemption's).
COMPONENT = "gpushared-extender"

#: How often the event loop looks whether both informers have listed, before the extender is ready.
LISTED_POLL_SECONDS = 0.05
#: An event loop that has run no timer for this long is wedged: the process exits (``tasks.watchdog``).
WEDGED_SECONDS = 60.0


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
    #: where <prefix>/mutate sends new pods that ask for GPU memory (core/placement/admission.py)
    webhook_scheduler: str = GPUSHARED_SCHEDULER
    #: the operator's expected mix (``--expected-mix``), counted beside the pods seen (core/placement/mixbook.py)
    expected: ExpectedMix | None = None
    #: the claim allocator's (``--claim-allocator``: DRA claims placed by gpushared's policies, not kube-scheduler's
    #: first fit), or None: DRA claims are kube-scheduler's
    claims: AllocatorSettings | None = None
    #: the webhook gates CPU-only pods and the leader steers them off idle GPUs (``--steer-cpu-pods``)
    steer: bool = False
    #: the most pods preemption evicts a minute for the preemptors of one namespace (0: none)
    max_evictions_per_minute: int = MAX_EVICTIONS_PER_MINUTE

    @property
    def own_url(self) -> str:
        scheme = "https" if self.server.tls_cert else "http"
        return f"{scheme}://{self.advertise_address or self.server.address}:{self.server.port}"


class Extender:
    """One replica: ready once its cache has listed and applied everything, serving verbs while it leads
    (or when not electing)."""

    def __init__(self, settings: ExtenderSettings, *, api: Api, binder: AsyncApi) -> None:
        self.settings = settings
        # Once, tried once, briefly: an API server not reachable yet must not hold the start (the safe
        # window of before is used then).
        version = api.without_retries().server_version(timeout=VERSION_READ_SECONDS)
        budgets = "policy/v1" if version is None or version >= (1, 21) else "policy/v1beta1"
        self.cache = cache = ClusterCache(
            list_nodes=api.rest.lister("/api/v1/nodes", what="nodes"),
            list_pods=api.rest.lister("/api/v1/pods", what="pods"),
            resources=settings.resources,
            watch_seconds=settings.watch_seconds,
            landing_seconds=settings.binding_landing_seconds,
            model_label=settings.model_label,
            rooms=settings.policy.reads_rooms,
            expected=settings.expected,
            schedulers=frozenset({"default-scheduler", settings.webhook_scheduler}),
            list_budgets=api.rest.lister(f"/apis/{budgets}/poddisruptionbudgets", what="poddisruptionbudgets"),
        )
        # Each mix after the first is built off the event loop (extender.mixing); the pricing after it is not.
        cache.state.taker = self.taker = MixTaker(cache.state.book)
        cache.reservations.fence_seconds = fence_window(version, landing=settings.binding_landing_seconds)
        log.info(
            "API server %s: binds fenced for up to %.0f s after a start or a takeover",
            "unknown" if version is None else f"v{version[0]}.{version[1]}",
            cache.reservations.fence_seconds,
        )
        self.heartbeat = Heartbeat()
        self.elector = self._elector(api, settings.lease)
        #: set on the loop once the cache is prepared; read by the probes and the verbs
        self.prepared = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.claim_cache: ClaimCache | None = None
        self.allocator: ClaimAllocator | None = None
        if settings.claims is not None:
            self.claim_cache = ClaimCache(driver=settings.claims.driver, device_class=settings.claims.device_class)
            self.claim_cache.watch(api.rest, cache.owner, watch_seconds=settings.watch_seconds)
        scheduler = Scheduler(
            cache=cache,
            api=binder,
            policy=settings.policy,
            resources=settings.resources,
            rank_in_filter=settings.rank_in_filter,
            may_bind=lambda: self.leader() is None,
            ledger_of=None if self.claim_cache is None else idle_ledger(cache, self.claim_cache),
        )
        self.steerer: Steerer | None = None
        if settings.steer:
            self.steerer = Steerer(cache, binder, ledger_of=idle_ledger(cache, self.claim_cache))
        self.preempter = Preempter(
            cache,
            settings.resources,
            clock=time.monotonic,
            nominations=scheduler.nominations,
            max_evictions_per_minute=settings.max_evictions_per_minute,
        )
        if self.claim_cache is not None and settings.claims is not None:
            self.allocator = ClaimAllocator(
                cache, self.claim_cache, binder, settings.claims, event=claim_events(api), cap=self.preempter.cap
            )
        self.evictor = Evictor(
            cache,
            binder,
            self.preempter,
            settings.resources,
            schedulers=frozenset({"default-scheduler", settings.webhook_scheduler}),
            policy_v1=version is None or version >= (1, 22),
            event=pod_events(api, component=COMPONENT, normal=frozenset({"Preempted", "Preempting"})),
        )
        self.primer = Primer(cache, policy=settings.policy, resources=settings.resources, ready=lambda: self.prepared)
        cache.pending_seen = self.primer.offer
        self.metrics = metrics = ExtenderMetrics()
        metrics.observe(
            cache,
            leading=lambda: self.leader() is None,
            primer=self.primer,
            allocator=self.allocator,
            steerer=self.steerer,
            preempter=self.preempter,
            evictor=self.evictor,
        )
        self.tls = ServingTls(settings.server, expiry=metrics.certificate_expiry)
        guard = Guard(
            settings.server,
            tls=self.tls,
            ready=self.ready,
            leader=self.leader,
            seconds=metrics.seconds,
            errors=metrics.errors,
        )
        self.routes = Routes(
            scheduler,
            guard,
            metrics=metrics,
            prefix=settings.server.prefix,
            webhook_scheduler=settings.webhook_scheduler,
            public_pod_names=settings.server.public_pod_names,
            max_nodes=settings.server.max_nodes,
            claim_gating=None if self.claim_cache is None else self.claim_cache.gating_of,
            steer_gating=None if self.steerer is None else self._lease_held,
            claims_problem=None if self.allocator is None else self._claims_problem,
            preempter=self.preempter,
        )
        self.app = self._application(scheduler)

    def _elector(self, api: Api, lease: LeaseSettings | None) -> LeaderElector | None:
        if lease is None:
            return None
        return LeaderElector(
            api.rest,
            namespace=lease.namespace,
            name=lease.name,
            identity=f"{lease.identity} {self.settings.own_url}",
            lease_seconds=lease.seconds,
            renew_deadline=lease.seconds * 2 / 3,
            retry_seconds=lease.seconds / 7.5,
            alive=self.heartbeat.alive,
            on_lead=self._took_the_lease,
        )

    def _application(self, scheduler: Scheduler) -> web.Application:
        app = application(self.routes, self.settings.server)

        async def close(app: web.Application) -> None:
            await self.routes.close()

        app.on_cleanup.append(close)
        app.cleanup_ctx.append(in_background("prepare", self._prepare_when_listed))
        app.cleanup_ctx.append(settling(scheduler))
        app.cleanup_ctx.append(watching_the_loop(self.metrics, self.ready, self.heartbeat))
        app.cleanup_ctx.append(in_background("prime", self.primer.run))
        allocator, claim_cache = self.allocator, self.claim_cache
        if allocator is not None and claim_cache is not None:

            async def allocate() -> None:
                await allocator.run(
                    leading=lambda: self.leader() is None, ready=lambda: self.prepared and claim_cache.listed()
                )

            app.cleanup_ctx.append(in_background("claim-allocator", allocate))
        steerer = self.steerer
        if steerer is not None:

            async def steer() -> None:
                await steerer.run(
                    leading=lambda: self.leader() is None,
                    ready=lambda: self.prepared and (claim_cache is None or claim_cache.listed()),
                )

            app.cleanup_ctx.append(in_background("steerer", steer))
        evictor = self.evictor

        async def evict() -> None:
            await evictor.run(leading=lambda: self.leader() is None, ready=lambda: self.prepared)

        app.cleanup_ctx.append(in_background("evictor", evict))
        return app

    def ready(self) -> tuple[bool, str]:
        """Prepared, and no watch known to be behind: a stale cache would place pods on GPUs already taken."""
        if not self.prepared:
            return False, "the cache has not synced with the API server yet"
        stale = self.cache.stale()
        return (False, f"the cache is stale: {stale}") if stale else (True, "")

    def _claims_problem(self) -> str | None:
        """What stops the claim allocator now: a permission the API server refuses it (on the leader, which
        writes; a follower writes nothing and reports nothing)."""
        allocator = self.allocator
        if allocator is None or allocator.writes.refusals.why is None:
            return None
        return allocator.writes.refusals.reason()

    def leader(self) -> str | None:
        """Serve here when leading (or not electing); else the leader's URL, from its Lease identity."""
        if self.elector is None or self.elector.leading:
            return None
        holder = self.elector.holder.rsplit(" ", 1)
        return holder[1] if len(holder) == 2 and holder[1].startswith(("http://", "https://")) else ""

    def _lease_held(self) -> bool:
        """Whether a leader holds the Lease as this replica last saw it (or none is elected): the webhook gates
        pods for steering only then, so that pods never wait on a leader that is gone."""
        return self.elector is None or self.elector.leading or self.elector.held

    def _took_the_lease(self) -> None:
        """On the election thread: the fence is armed on the loop, which owns the cache."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._fence_after_takeover)

    def _fence_after_takeover(self) -> None:
        """A new leader binds nothing its predecessor may still have in flight (``reservations.fenced``).
        Before the cache is prepared there is nothing to read: the fence is armed then."""
        if self.prepared and self.elector is not None:
            # The predecessor stopped binding when it could not renew within its renew deadline; this replica
            # took the Lease a whole lease duration after it last saw it renewed: the gap between the two has
            # passed already (``kube.lease``: the times are this replica's own).
            stepped_down = self.elector.lease_seconds - self.elector.renew_deadline
            self.cache.arm_fence(since=self.cache.reservations.clock() - stepped_down)

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT."""
        threading.Thread(target=self._watch_the_loop, name="liveness", daemon=True).start()

        async def serving() -> None:
            loop = self._loop = asyncio.get_running_loop()
            self.cache.owner.claim()  # this thread, the loop's, owns the cluster state from here on
            self.cache.inbox.attach(loop)
            self.cache.start()
            if self.claim_cache is not None:
                self.claim_cache.start(loop)
            if self.elector is not None:
                self.elector.start()
            stop = asyncio.Event()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
            server = self.settings.server
            await serve(self.app, self.routes, server, tls=self.tls, connections=self.metrics.connections, stop=stop)

        try:
            uvloop.run(serving())  # cheaper loop turns: docs/benchmarks.md, "What changed, second pass"
        finally:
            if self.elector is not None:
                self.elector.stop()
            self.cache.stop()
            if self.claim_cache is not None:
                self.claim_cache.stop()
            self.taker.close()

    def _watch_the_loop(self) -> None:
        watchdog(self.heartbeat, within=WEDGED_SECONDS, exit=_exit, sleep=time.sleep)

    async def _prepare_when_listed(self) -> None:
        """Once both informers have listed: apply what they listed, warm the index, fence binds, keep what
        the cache holds out of the garbage collector's walks, and only then say ready.

        Cached pods live as long as their pods do, and 150k of them are about a million tracked objects:
        every full collection would walk them all, a pause in the middle of some filter. Frozen, they are
        still freed by reference counting when the watch drops them (they hold no cycles)."""
        while not self.cache.listed():
            await asyncio.sleep(LISTED_POLL_SECONDS)
        self.cache.prepare()  # arms the fence: a process killed before this one may have left Bindings in flight
        gc.freeze()
        log.info("cache synced; %d objects kept out of the garbage collector's walks", gc.get_freeze_count())
        self.prepared = True


def run(settings: ExtenderSettings, *, api: Api, binder: AsyncApi) -> None:
    Extender(settings, api=api, binder=binder).run()


def _exit(status: int) -> None:
    logging.shutdown()
    os._exit(status)
