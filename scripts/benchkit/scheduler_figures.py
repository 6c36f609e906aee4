"""kube-scheduler's and the API server's figures from their metrics pages; throughput as scheduler_perf counts it."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def families(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus text page as {(sample name, labels): value}."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def summed(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, by: str) -> dict[str, Any]:
    """``<name>_sum`` and ``_count`` per value of the label ``by``: seconds in all, calls, mean ms."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    for (sample, labels), value in samples.items():
        key = dict(labels).get(by, "")
        if sample == f"{name}_sum":
            sums[key] += value
        elif sample == f"{name}_count":
            counts[key] += value
    return {
        key: {"seconds": round(sums[key], 3), "calls": int(counts[key]),
              "meanMs": round(1000 * sums[key] / counts[key], 3) if counts[key] else None}
        for key in sorted(sums)
    }  # fmt: skip


def apiserver_time(before: str, after: str) -> dict[str, Any]:
    """The API server's request seconds during the mode, per verb and resource (the largest first)."""
    name = "apiserver_request_duration_seconds"
    first, last = families(before), families(after)
    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (sample, labels), value in last.items():
        if sample not in (f"{name}_sum", f"{name}_count"):
            continue
        label = dict(labels)
        if label.get("verb") == "WATCH":
            continue  # a watch lasts as long as its client: its seconds are not work
        key = f"{label.get('verb')} {label.get('resource')}" + (
            f"/{label['subresource']}" if label.get("subresource") else ""
        )
        delta = value - first.get((sample, labels), 0.0)
        spent[key][0 if sample.endswith("_sum") else 1] += delta
    top = sorted(spent.items(), key=lambda item: -item[1][0])[:8]
    return {key: {"seconds": round(s, 2), "calls": int(c)} for key, (s, c) in top if c}


#: Each figure of kube-scheduler's breakdown and the metrics that carry it, the first one a version serves
#: taken: 1.23 added ``scheduling_attempt_duration_seconds`` in place of ``e2e_scheduling_duration_seconds``
#: (gone since), and ``binding_duration_seconds`` went too, the Bind extension point's histogram holding the
#: same time (labelled ``extension_point``, as ``extensionPoints`` below reads it). That extension point runs
#: the Bind plugins only: where an extender binds, kube-scheduler records no Bind sample (1.36: none with the
#: extender wired), and the extender's own bind latency (``extender.bind`` in the report) is the bind's time.
SCHEDULER_FIGURES: dict[str, tuple[tuple[str, str, str | None], ...]] = {
    # figure: ((metric, label to break down by, the extension point it is restricted to or None), ...)
    "e2e_scheduling_duration": (
        ("scheduler_e2e_scheduling_duration_seconds", "result", None),
        ("scheduler_scheduling_attempt_duration_seconds", "result", None),
    ),
    "scheduling_algorithm_duration": (("scheduler_scheduling_algorithm_duration_seconds", "result", None),),
    "binding_duration": (
        ("scheduler_binding_duration_seconds", "result", None),
        ("scheduler_framework_extension_point_duration_seconds", "status", "Bind"),
    ),
}


def scheduler_breakdown(text: str) -> dict[str, Any]:
    """Where kube-scheduler's time went, by figure (``SCHEDULER_FIGURES``), each read from the first of its
    metrics this version serves (named in ``sources``; a figure none of them carries is empty)."""
    samples = families(text)
    served = {name for name, _ in samples}
    out: dict[str, Any] = {"sources": {}}
    for figure, metrics in SCHEDULER_FIGURES.items():
        out[figure] = {}
        for metric, by, point in metrics:
            if f"{metric}_count" in served:
                chosen = {k: v for k, v in samples.items() if point is None or ("extension_point", point) in k[1]}
                out[figure] = summed(chosen, metric, by=by)
                out["sources"][figure] = metric + (f'{{extension_point="{point}"}}' if point else "")
                break
    out["extensionPoints"] = summed(samples, "scheduler_framework_extension_point_duration_seconds", "extension_point")
    return out


def throughput(times: list[float]) -> dict[str, Any]:
    """scheduler_perf's figures: pods per second from the first bind to the last, and per 1-second window."""
    times = sorted(times)
    if len(times) < 2:
        return {"bound": len(times)}
    span = times[-1] - times[0]
    windows: dict[int, int] = defaultdict(int)
    for t in times:
        windows[int(t - times[0])] += 1
    per_second = [windows.get(i, 0) for i in range(int(span) + 1)]
    full = per_second[:-1] or per_second  # the last window is cut short
    return {
        "bound": len(times),
        "seconds": round(span, 2),
        "podsPerSecond": round((len(times) - 1) / span, 1) if span else None,
        "perSecond": {"p50": statistics.median(full), "max": max(full), "min": min(full)},
    }
