"""Every series the daemon and the extender expose, held to Prometheus's naming rules.

The rules (prometheus.io, "Metric and label naming"; "Writing exporters"): a name matches
``[a-zA-Z_:][a-zA-Z0-9_:]*`` without the colons that recording rules own; one application prefix; base units
(seconds, bytes), never milli-, kibi- or "units" of a configurable size; ``_total`` on counters and on
nothing else; the unit before any ``_total``; ``_info`` gauges of value 1 for metadata; labels that are not
reserved (``__*``, ``le``, ``quantile``); help text on every metric.
"""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpushared.contract import GpuInfo
from gpushared.daemon.metrics import ContainerMemory, PodShare
from gpushared.daemon.metrics import DaemonMetrics as NodeMetrics
from gpushared.extender.metrics import ExtenderMetrics

NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
NOT_BASE_UNITS = {"ms", "milliseconds", "us", "microseconds", "minutes", "hours", "days", "kb", "mb", "gb", "kib",
                  "mib", "gib", "units", "percent"}  # fmt: skip
RESERVED_LABELS = {"le", "quantile"}


def node_registry() -> CollectorRegistry:
    metrics = NodeMetrics(hostname="node-a")
    gpu = GpuInfo(index=0, uuid="GPU-0", model="NVIDIA H100 80GB HBM3", memory=80, memory_mib=81559)
    # One child of every labelled metric, so that its samples (and their label names) are exposed.
    for gauge in (metrics.gpu_total, metrics.gpu_used, metrics.gpu_healthy, metrics.mps_up):
        gauge.labels(**metrics.gpu_labels(gpu)).set(1)
    metrics.mps_restarts.labels(**metrics.gpu_labels(gpu)).inc()
    metrics.gpu_events.labels(kind="xid", xid="79").inc()
    metrics.allocate_seconds.observe(0.01)
    metrics.watch_pods(lambda: [PodShare("default", "p", 0, "GPU-0", 2**30)])
    metrics.watch_claims(lambda: [PodShare("default", "claim-a", 0, "GPU-0", 2**30)])
    metrics.watch_containers(lambda: [ContainerMemory("default", "p", "c", 0, "GPU-0", 2**31, 2**30)])
    metrics.overrun_kills.labels(reason="kill").inc()
    metrics.usage_polls.observe(0.01)
    return metrics.registry


def extender_registry() -> CollectorRegistry:
    metrics = ExtenderMetrics()
    metrics.seconds.labels(verb="filter").observe(0.001)
    metrics.errors.labels(verb="bind").inc()
    return metrics.registry


@pytest.mark.parametrize("registry", [node_registry(), extender_registry()], ids=["node", "extender"])
def test_names_follow_prometheus_conventions(registry: CollectorRegistry) -> None:
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    assert families
    for family in families:
        name, kind = family.name, family.type
        words = name.split("_")
        assert NAME.match(name), f"{name}: lower snake case, no colons"
        assert name.startswith("gpushared_"), f"{name}: one prefix for the application"
        assert family.documentation.strip(), f"{name}: no help text"
        assert not NOT_BASE_UNITS & set(words), f"{name}: not a base unit (seconds, bytes)"
        if "memory" in words:
            assert name.endswith("_bytes"), f"{name}: memory in bytes"
        if kind == "histogram":
            assert words[-1] in ("seconds", "bytes"), f"{name}: a histogram observes seconds or bytes"
        if name.endswith("_info"):
            assert kind == "gauge" and all(s.value == 1 for s in family.samples), f"{name}: an info metric is 1"
        for sample in family.samples:
            if kind == "counter":
                assert sample.name.endswith(("_total", "_created")), f"{sample.name}: a counter ends in _total"
            else:
                assert not sample.name.endswith("_total"), f"{sample.name}: _total on a {kind}"
            for label in sample.labels:
                if kind == "histogram" and label == "le":
                    continue
                assert LABEL.match(label) and not label.startswith("__"), f"{name}: label {label!r}"
                assert label not in RESERVED_LABELS, f"{name}: reserved label {label!r}"


def test_both_components_say_what_they_are() -> None:
    for registry, component in ((node_registry(), "node"), (extender_registry(), "extender")):
        text = generate_latest(registry).decode()
        assert f'gpushared_build_info{{component="{component}"' in text
    assert "gpushared_extender_leader" in generate_latest(extender_registry()).decode()
    assert "gpushared_pod_gpu_memory_bytes" in generate_latest(node_registry()).decode()


def test_every_gpu_series_carries_dcgm_exporters_labels_beside_ours() -> None:
    """dcgm-exporter labels a GPU's series UUID, modelName and Hostname: gpushared's carry the same names and
    values beside gpu and uuid, so a query joins the two without label_replace."""
    families = list(text_string_to_metric_families(generate_latest(node_registry()).decode()))
    per_gpu = [s for f in families for s in f.samples if "uuid" in s.labels]
    names = {s.name.removesuffix("_total") for s in per_gpu}
    assert {
        "gpushared_gpu_memory_bytes", "gpushared_gpu_memory_allocated_bytes", "gpushared_gpu_healthy",
        "gpushared_mps_daemon_up", "gpushared_mps_daemon_restarts", "gpushared_pod_gpu_memory_bytes",
        "gpushared_container_gpu_memory_used_bytes", "gpushared_container_gpu_memory_allocated_bytes",
    } <= names  # fmt: skip
    for sample in per_gpu:
        assert sample.labels["UUID"] == sample.labels["uuid"] == "GPU-0", sample.name
        assert sample.labels["modelName"] == "NVIDIA H100 80GB HBM3", sample.name
        assert sample.labels["Hostname"] == "node-a", sample.name
