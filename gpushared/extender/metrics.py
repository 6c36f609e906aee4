"""The extender's Prometheus series; names as Prometheus's conventions want them (tests/unit/test_metric_names.py)."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from gpushared import __version__
from gpushared.extender.cache import ClusterCache


class WatchRestarts(Collector):
    """Watches listed again, per informer and reason: counts the informers keep, exposed as a counter."""

    def __init__(self) -> None:
        self.informers: list[Any] = []

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "gpushared_extender_watch_restarts",
            "Watches of the cache listed again because they went silent, or lagged behind a read-back",
            labels=("informer", "reason"),
        )
        for informer in self.informers:
            family.add_metric((informer.name, "silent"), informer.silent_watches)
            family.add_metric((informer.name, "lagging"), informer.lag_relists)
        yield family


class Primed(Collector):
    """Slots the primer priced on every node before kube-scheduler asked (``priming.Primer``), as a counter
    read from the primer itself."""

    def __init__(self) -> None:
        self.primer: Any = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "gpushared_extender_slots_primed",
            "Request sizes (with what else a rank reads) priced on every node when their first pod was seen "
            "pending, before kube-scheduler asked",
            value=self.primer.slots_primed if self.primer is not None else 0,
        )


class Preemptions(Collector):
    """What the preempt verb made of the nodes kube-scheduler proposed (``preempting.Preempter``), and the
    preemptors whose freed GPUs are held, read from it."""

    OUTCOMES = ("kept", "dropped", "passed", "capped")

    EVICTIONS = ("evicted", "refused", "gone", "failed", "capped")

    def __init__(self) -> None:
        self.preempter: Any = None
        self.evictor: Any = None

    def collect(self) -> Iterator[Any]:
        evictions = self.evictor.counts if self.evictor is not None else {}
        family = CounterMetricFamily(
            "gpushared_extender_evictions",
            "Pods the extender evicted itself for preemptors kube-scheduler never asked the preempt verb for: "
            "evicted, refused (a PodDisruptionBudget), gone meanwhile, failed, or capped (not tried: the "
            "preemptor's namespace evicted its most this minute)",
            labels=("outcome",),
        )
        for outcome in self.EVICTIONS:
            family.add_metric((outcome,), evictions.get(outcome, 0))
        yield family
        counts = self.preempter.counts if self.preempter is not None else {}
        family = CounterMetricFamily(
            "gpushared_extender_preemption_nodes",
            "Nodes kube-scheduler proposed for a preemption: kept with pods to evict that free a GPU, dropped "
            "because none does, passed with kube-scheduler's own choice (a pod without GPU memory), or capped "
            "(the preemptor's namespace evicted its most this minute)",
            labels=("outcome",),
        )
        for outcome in self.OUTCOMES:
            family.add_metric((outcome,), counts.get(outcome, 0))
        yield family
        offers = self.preempter.nominations.offers if self.preempter is not None else {}
        yield GaugeMetricFamily(
            "gpushared_extender_preemptors_held",
            "Preempting pods whose freed GPUs are held for them until they bind",
            value=len(offers),
        )


class ClaimAllocations(Collector):
    """The claim allocator's outcomes and waits (``claims.allocator.ClaimAllocator``), read from it."""

    #: every outcome it counts, exposed from the start at 0
    OUTCOMES = ("allocated", "handover", "timeout", "conflict", "released", "not_gated", "not_ours", "refused")
    #: what its preemptions came to (``claims.preempting.ClaimPreempter.counts``)
    PREEMPTIONS = ("evicted", "refused", "gone", "failed", "capped", "coming", "no_victims")

    def __init__(self) -> None:
        self.allocator: Any = None

    def collect(self) -> Iterator[Any]:
        allocator = self.allocator
        if allocator is None:
            return
        family = CounterMetricFamily(
            "gpushared_extender_claim_pods",
            "Pods the claim allocator dealt with, per outcome: allocated (claims written, gate removed), handover "
            "(left to kube-scheduler, with the reason in an Event), timeout (--claim-handover-after), conflict (a "
            "status write refused, tried again), released (claims of a pod deleted while gated), not_gated (pods "
            "that reached kube-scheduler without the gate), not_ours (gated while its claims were not known yet, "
            "ungated once none was ours), refused (a write the API server refused for want of a permission: "
            "see gpushared_extender_claim_writes_refused)",
            labels=("outcome",),
        )
        for outcome in self.OUTCOMES:
            family.add_metric((outcome,), allocator.counts[outcome])
        yield family
        yield CounterMetricFamily(
            "gpushared_extender_claim_fence_holds",
            "Allocations the claim allocator held back because the pod fits only in the room kept free for pods "
            "kube-scheduler was given ungated and may be allocating claims for (decided again at the next step)",
            value=allocator.counts["fenced"],
        )
        latencies = allocator.latencies
        yield SummaryMetricFamily(
            "gpushared_extender_claim_gated_seconds",
            "Seconds from the claim allocator first seeing a pod gated to its gate removed with its claims allocated",
            count_value=len(latencies),
            sum_value=sum(latencies),
        )
        yield GaugeMetricFamily(
            "gpushared_extender_claim_writes_refused",
            "1 while the API server refuses the claim allocator a permission it needs (it then writes nothing but "
            "one write every 30 s; the log and /readyz/claim-allocator say which), else 0",
            value=int(allocator.writes.refusals.why is not None),
        )
        yield GaugeMetricFamily(
            "gpushared_extender_claim_pods_waiting",
            "Gated pods the claim allocator is waiting with (no room, a claim not made yet, kube-scheduler busy)",
            value=len(allocator.told),
        )
        preempter = allocator.preempter
        family = CounterMetricFamily(
            "gpushared_extender_claim_preemptions",
            "The claim allocator's preemptions for gated pods that fit nowhere, per outcome: evicted (a pod), "
            "refused (an eviction a PodDisruptionBudget forbade: the hold goes), gone (a victim gone meanwhile), "
            "failed (an eviction that may have landed), capped (no eviction: the preemptor's namespace evicted its "
            "most this minute), coming (room held that pods already terminating free), no_victims (no node had "
            "lower-priority pods whose eviction frees the room)",
            labels=("outcome",),
        )
        for outcome in self.PREEMPTIONS:
            family.add_metric((outcome,), preempter.counts[outcome])
        yield family
        yield GaugeMetricFamily(
            "gpushared_extender_claim_preemptors_held",
            "Gated pods the room freed by a preemption is held for, until their claims are allocated",
            value=len(preempter.holds),
        )


class Steered(Collector):
    """The steerer's outcomes and waits (``steering.Steerer``), read from it."""

    def __init__(self) -> None:
        self.steerer: Any = None

    def collect(self) -> Iterator[Any]:
        steerer = self.steerer
        if steerer is None:
            return
        family = CounterMetricFamily(
            "gpushared_extender_steered_pods",
            "CPU-only pods the steerer ungated, per outcome: steered (given a preferred node affinity for the nodes "
            "the extender ranks best), unsteered (every node the pod may use the same to the extender)",
            labels=("outcome",),
        )
        for outcome in ("steered", "unsteered"):
            family.add_metric((outcome,), steerer.counts[outcome])
        yield family
        latencies = steerer.latencies
        yield SummaryMetricFamily(
            "gpushared_extender_steer_gated_seconds",
            "Seconds from the steerer first seeing a CPU-only pod gated to its gate removed",
            count_value=len(latencies),
            sum_value=sum(latencies),
        )


class ExtenderMetrics:
    """The extender's series; names as Prometheus's conventions want them (tests/unit/test_metric_names.py)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        Gauge(
            "gpushared_build_info",
            "Always 1; the labels say which gpushared this is",
            ("component", "version", "python"),
            registry=self.registry,
        ).labels(component="extender", version=__version__, python=platform.python_version()).set(1)
        self.leader = Gauge(
            "gpushared_extender_leader",
            "1 while this replica answers kube-scheduler itself (it holds the Lease, or runs without election)",
            registry=self.registry,
        )
        self.seconds = Histogram(
            "gpushared_extender_request_seconds",
            "Time to answer kube-scheduler, per verb",
            ("verb",),
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.errors = Counter(
            "gpushared_extender_errors", "Requests answered with an error, per verb", ("verb",), registry=self.registry
        )
        self.nodes = Gauge("gpushared_extender_nodes", "gpushared nodes in the cache", registry=self.registry)
        self.stale = Gauge(
            "gpushared_extender_cache_stale",
            "1 while a watch of the cache is silent past its bound or being listed again after it lagged",
            registry=self.registry,
        )
        self.watch_restarts = WatchRestarts()
        self.registry.register(self.watch_restarts)
        self.primed = Primed()
        self.registry.register(self.primed)
        self.claims = ClaimAllocations()
        self.registry.register(self.claims)
        self.steered = Steered()
        self.registry.register(self.steered)
        self.preemptions = Preemptions()
        self.registry.register(self.preemptions)
        self.allocation_edits = Gauge(
            "gpushared_extender_allocation_edits",
            "Bound pods whose GPU annotations were edited to name other GPUs; the cache keeps their GPUs",
            registry=self.registry,
        )
        self.unreadable_pods = Gauge(
            "gpushared_extender_unreadable_pods",
            "Bound pods whose GPU annotations cannot be read: counted at their spec amounts on their node, on no GPU",
            registry=self.registry,
        )
        self.loop_lag = Gauge(
            "gpushared_extender_event_loop_lag_max_seconds",
            "The longest the event loop was late to a 20 ms timer since start: how long one request held it",
            registry=self.registry,
        )
        # Over HTTP/1.1 kube-scheduler's extender client keeps two idle connections per extender (Go's
        # default), so binds in flight beside a filter open new ones, each a full (mutual) TLS handshake on
        # both sides; over HTTP/2 (ALPN "h2", what it offers over TLS) every call is a stream on one
        # connection. The rate this grows at is that churn (docs/benchmarks.md, "The scheduler with the
        # extender"). Counted once the protocol is known: after the TLS handshake, when there is one.
        self.connections = Counter(
            "gpushared_extender_connections",
            "Connections accepted on the extender's port, per HTTP version they speak",
            ("protocol",),
            registry=self.registry,
        )
        # As cert-manager's certmanager_certificate_expiration_timestamp_seconds: alert on time() - it.
        self.certificate_expiry = Gauge(
            "gpushared_extender_certificate_expiry_seconds",
            "When the certificate served (serving) or trusted for clients (client-ca) expires, in Unix seconds; "
            "read again whenever the files change",
            ("certificate",),
            registry=self.registry,
        )
        self.in_doubt = Gauge(
            "gpushared_extender_fenced_pods",
            "Pods pending when this extender started or took the Lease whose Bindings an earlier extender may "
            "still have in flight: while not 0, binds wait (at most --binding-landing-seconds)",
            registry=self.registry,
        )
        self.unconfirmed = Gauge(
            "gpushared_extender_unconfirmed_binds",
            "Binds counted in the cache that neither the watch nor a read-back has confirmed yet",
            registry=self.registry,
        )

    def observe(
        self,
        cache: ClusterCache,
        *,
        leading: Callable[[], bool],
        primer: Any,
        allocator: Any = None,
        steerer: Any = None,
        preempter: Any = None,
        evictor: Any = None,
    ) -> None:
        """Read the gauges from the cache (on the event loop, which serves /metrics and owns the cache)."""
        state, reservations = cache.state, cache.reservations
        self.stale.set_function(lambda: 1.0 if cache.stale() else 0.0)
        self.unconfirmed.set_function(reservations.unconfirmed)
        self.in_doubt.set_function(reservations.in_doubt)
        self.allocation_edits.set_function(lambda: state.allocation_edits)
        self.unreadable_pods.set_function(lambda: len(state.unreadable))
        self.watch_restarts.informers = [cache.nodes, cache.pods]
        self.leader.set_function(lambda: 1.0 if leading() else 0.0)
        self.primed.primer = primer
        self.claims.allocator = allocator
        self.steered.steerer = steerer
        self.preemptions.preempter = preempter
        self.preemptions.evictor = evictor
