"""The daemon's Prometheus metrics, in a registry of its own (one per daemon, also in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("gpu", "uuid")
        self.gpu_total = Gauge(
            "gpushared_gpu_memory_units", "GPU memory advertised, in the node's unit", labels, registry=self.registry
        )
        self.gpu_used = Gauge(
            "gpushared_gpu_memory_allocated_units",
            "GPU memory held by pods, in the node's unit",
            labels,
            registry=self.registry,
        )
        self.gpu_healthy = Gauge("gpushared_gpu_healthy", "1 if the GPU is healthy", labels, registry=self.registry)
        self.allocate_seconds = Histogram(
            "gpushared_allocate_seconds",
            "Time to answer kubelet's Allocate, pod lookup included",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.allocations = Counter("gpushared_allocations", "Containers given a GPU", registry=self.registry)
        self.allocate_failures = Counter(
            "gpushared_allocate_failures", "Allocate calls refused", registry=self.registry
        )
        self.allocation_edits = Counter(
            "gpushared_allocation_edits",
            "Pods whose GPU annotations were edited after Allocate; the daemon counts the GPUs it gave",
            registry=self.registry,
        )
        self.registrations = Counter(
            "gpushared_kubelet_registrations", "Successful registrations with the kubelet", registry=self.registry
        )
        self.gpu_events = Counter(
            "gpushared_gpu_events",
            "Critical GPU events seen, ignored ones included",
            ("kind", "xid"),
            registry=self.registry,
        )
        self.mps_up = Gauge(
            "gpushared_mps_daemon_up", "1 while the GPU's MPS control daemon answers", labels, registry=self.registry
        )
        self.mps_restarts = Counter(
            "gpushared_mps_daemon_restarts",
            "MPS control daemons started again after they died or hung",
            labels,
            registry=self.registry,
        )
