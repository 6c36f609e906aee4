"""The daemon's Prometheus metrics, in a registry of its own (one per daemon, also in tests).

Names follow Prometheus's conventions (tests/unit/test_metric_names.py checks them): base units (``_bytes``,
``_seconds``), ``_total`` on counters, ``gpushared_build_info`` for the version. GPU memory is published in
bytes whatever the node's memoryUnit, so that dashboards need not know it.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpushared import __version__
from gpushared.contract import GpuInfo
from gpushared.nvml.backend import GpuDevice


@dataclass(frozen=True)
class PodShare:
    """One pod's GPU memory on one GPU, for the per-pod series."""

    namespace: str
    pod: str
    gpu: int
    uuid: str
    bytes: int


@dataclass(frozen=True)
class ContainerMemory:
    """What one container uses and was allocated on one GPU, as the last memory poll read it."""

    namespace: str
    pod: str
    container: str
    gpu: int
    uuid: str
    used_bytes: int
    allocated_bytes: int


def build_info(registry: CollectorRegistry, component: str) -> None:
    info = Gauge(
        "gpushared_build_info",
        "Always 1; the labels say which gpushared this is",
        ("component", "version", "python"),
        registry=registry,
    )
    info.labels(component=component, version=__version__, python=platform.python_version()).set(1)


#: Every per-GPU series carries ours (``gpu``, ``uuid``) and dcgm-exporter's (``UUID``, ``modelName``,
#: ``Hostname``), so that a query joins gpushared's series with DCGM's without ``label_replace``.
DCGM_LABELS = ("UUID", "modelName", "Hostname")
GPU_LABELS = ("gpu", "uuid", *DCGM_LABELS)
#: uuid -> dcgm-exporter's label values for that GPU
Describe = Callable[[str], tuple[str, str, str]]


class PodSeries(Collector):
    """``gpushared_pod_gpu_memory_bytes`` per pod and GPU, read from the node's ledger at each scrape: a pod
    that is gone has no series, with no cleanup to forget. In DRA mode, the same for each prepared claim:
    ``gpushared_claim_gpu_memory_bytes{namespace,claim,...}`` (``PodShare.pod`` is then the claim's name)."""

    def __init__(
        self,
        shares: Callable[[], Iterable[PodShare]],
        describe: Describe,
        *,
        name: str = "gpushared_pod_gpu_memory_bytes",
        holder: str = "pod",
        documentation: str = "GPU memory a pod holds on a GPU of this node (its peak over init and app containers)",
    ) -> None:
        self.shares, self.dcgm = shares, describe  # not `describe`: the registry calls that
        self.name, self.holder, self.documentation = name, holder, documentation

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=("namespace", self.holder, *GPU_LABELS))
        for share in self.shares():
            family.add_metric(
                (share.namespace, share.pod, str(share.gpu), share.uuid, *self.dcgm(share.uuid)), share.bytes
            )
        yield family


class ContainerSeries(Collector):
    """``gpushared_container_gpu_memory_used_bytes`` and ``..._allocated_bytes`` per container and GPU, from
    the last memory poll: a container with no process on a GPU has no series there."""

    def __init__(self, usages: Callable[[], Iterable[ContainerMemory]], describe: Describe) -> None:
        self.usages, self.dcgm = usages, describe

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ("namespace", "pod", "container", *GPU_LABELS)
        used = GaugeMetricFamily(
            "gpushared_container_gpu_memory_used_bytes",
            "GPU memory a container's processes use on a GPU, as NVML reports it",
            labels=labels,
        )
        allocated = GaugeMetricFamily(
            "gpushared_container_gpu_memory_allocated_bytes",
            "GPU memory the container was allocated on that GPU (its share of its pod's gpu-mem)",
            labels=labels,
        )
        for usage in self.usages():
            values = (
                usage.namespace,
                usage.pod,
                usage.container,
                str(usage.gpu),
                usage.uuid,
                *self.dcgm(usage.uuid),
            )
            used.add_metric(values, usage.used_bytes)
            allocated.add_metric(values, usage.allocated_bytes)
        yield used
        yield allocated


@dataclass(frozen=True)
class ContainerCompute:
    """What one container's processes use of one GPU's SMs (0-1), and its pod's compute limit (None: none)."""

    namespace: str
    pod: str
    container: str
    gpu: int
    uuid: str
    used: float
    limit: float | None


class ComputeSeries(Collector):
    """``gpushared_container_gpu_compute_used_ratio`` (and ``..._limit_ratio`` for pods that gave a limit)
    per container and GPU, from the last poll's NVML samples."""

    def __init__(self, usages: Callable[[], Iterable[ContainerCompute]], describe: Describe) -> None:
        self.usages, self.dcgm = usages, describe

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ("namespace", "pod", "container", *GPU_LABELS)
        used = GaugeMetricFamily(
            "gpushared_container_gpu_compute_used_ratio",
            "Share of a GPU's SMs a container's processes used, 0-1, as NVML's samples report it",
            labels=labels,
        )
        limit = GaugeMetricFamily(
            "gpushared_container_gpu_compute_limit_ratio",
            "The compute limit of the container's pod, 0-1 (gpushared.io/gpu-compute-limit)",
            labels=labels,
        )
        for usage in self.usages():
            values = (usage.namespace, usage.pod, usage.container, str(usage.gpu), usage.uuid, *self.dcgm(usage.uuid))
            used.add_metric(values, usage.used)
            if usage.limit is not None:
                limit.add_metric(values, usage.limit)
        yield used
        yield limit


class DaemonMetrics:
    def __init__(self, *, hostname: str = "") -> None:
        """``hostname``: dcgm-exporter's ``Hostname`` label, the node's name."""
        self.registry = CollectorRegistry()
        self.hostname = hostname
        #: uuid -> model, from the GPUs labelled so far (gpu_labels)
        self._models: dict[str, str] = {}
        build_info(self.registry, "node")
        labels = GPU_LABELS
        self.gpu_total = Gauge(
            "gpushared_gpu_memory_bytes", "GPU memory advertised to the kubelet", labels, registry=self.registry
        )
        self.gpu_used = Gauge(
            "gpushared_gpu_memory_allocated_bytes", "GPU memory held by pods", labels, registry=self.registry
        )
        self.gpu_healthy = Gauge("gpushared_gpu_healthy", "1 if the GPU is healthy", labels, registry=self.registry)
        self.gpu_compute_requested = Gauge(
            "gpushared_gpu_compute_requested_ratio",
            "Share of the GPU's compute its pods are guaranteed, 0-1 (gpushared.io/gpu-compute-request)",
            labels,
            registry=self.registry,
        )
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
        self.unreadable_pods = Counter(
            "gpushared_unreadable_pods",
            "Pods whose GPU annotations could not be read, once per reason: counted at their spec amounts",
            registry=self.registry,
        )
        self.inventory_restored = Counter(
            "gpushared_inventory_restored",
            "Times the node's GPU inventory annotation was found changed by someone else and written again",
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

        # As the kubelet's certificate expiry gauge: alert on it minus time().
        self.credential_expiry = Gauge(
            "gpushared_credential_expiry_seconds",
            "When the daemon's ServiceAccount token expires, in Unix seconds (only tokens that expire)",
            registry=self.registry,
        )
        self.credential_renewal_failures = Counter(
            "gpushared_credential_renewal_failures",
            "Times asking the API server for the daemon's next token failed",
            registry=self.registry,
        )
        self.usage_polls = Histogram(
            "gpushared_usage_poll_seconds",
            "Time to read every GPU's processes and attribute them to containers",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )
        self.overruns = Counter(
            "gpushared_container_overruns",
            "Times a container went over its GPU memory allocation plus the tolerance",
            registry=self.registry,
        )
        self.compute_overruns = Counter(
            "gpushared_container_compute_overruns",
            "Times a container's SM use went over its pod's compute limit plus the tolerance (measured, not enforced)",
            registry=self.registry,
        )
        self.overrun_kills = Counter(
            "gpushared_overrun_kills",
            "Processes killed for GPU memory used past their container's allocation",
            ("reason",),
            registry=self.registry,
        )

        self._pods = PodSeries(lambda: (), self._describe)
        self.registry.register(self._pods)
        self._claims = PodSeries(
            lambda: (),
            self._describe,
            name="gpushared_claim_gpu_memory_bytes",
            holder="claim",
            documentation="GPU memory a DRA claim prepared on this node holds on a GPU (DRA mode)",
        )
        self.registry.register(self._claims)
        self._containers = ContainerSeries(lambda: (), self._describe)
        self.registry.register(self._containers)
        self._compute = ComputeSeries(lambda: (), self._describe)
        self.registry.register(self._compute)

    def gpu_labels(self, gpu: GpuInfo | GpuDevice) -> dict[str, str]:
        """The label values of ``gpu``'s series: ours and dcgm-exporter's."""
        self._models[gpu.uuid] = gpu.model
        return {
            "gpu": str(gpu.index),
            "uuid": gpu.uuid,
            **dict(zip(DCGM_LABELS, self._describe(gpu.uuid), strict=True)),
        }

    def _describe(self, uuid: str) -> tuple[str, str, str]:
        return uuid, self._models.get(uuid, ""), self.hostname

    def watch_pods(self, shares: Callable[[], Iterable[PodShare]]) -> None:
        """Where the per-pod series come from (the manager, once the daemon has one)."""
        self._pods.shares = shares

    def watch_claims(self, shares: Callable[[], Iterable[PodShare]]) -> None:
        """Where the per-claim series come from (the DRA driver's book, in DRA mode)."""
        self._claims.shares = shares

    def watch_containers(self, usages: Callable[[], Iterable[ContainerMemory]]) -> None:
        """Where the per-container memory series come from (the memory watcher)."""
        self._containers.usages = usages

    def watch_compute(self, usages: Callable[[], Iterable[ContainerCompute]]) -> None:
        """Where the per-container compute series come from (the compute watcher)."""
        self._compute.usages = usages
