"""--topology: the daemon's reading of links and NUMA nodes against nvidia-smi topo -m."""

from __future__ import annotations

import subprocess
import time

from gpucheck.report import finish


def check_topology() -> int:
    """The daemon's link matrix and NUMA nodes against nvidia-smi's, pair by pair."""
    from gpushared.core.shared.topology import Topology, parse_topo_matrix
    from gpushared.nvml.backend import NvmlBackend

    backend = NvmlBackend()
    backend.start()
    try:
        gpus, failed = backend.devices()
        started = time.perf_counter()
        links = backend.links(gpus)
        seconds = time.perf_counter() - started
    finally:
        backend.stop()
    ours = Topology(links=links)
    printed = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, check=True).stdout
    theirs, affinity = parse_topo_matrix(printed)
    indices = [gpu.index for gpu in gpus]
    pairs = [(a, b) for i, a in enumerate(indices) for b in indices[i + 1 :]]
    differ = [
        {"pair": [a, b], "gpushared": str(ours.link(a, b)), "nvidia-smi": str(theirs.link(a, b))}
        for a, b in pairs
        if str(ours.link(a, b)) != str(theirs.link(a, b))
    ]
    numa = {gpu.index: gpu.numa for gpu in gpus}
    numa_differ = {
        index: {"gpushared": node, "nvidia-smi": affinity.get(index)}
        for index, node in numa.items()
        if affinity.get(index) not in (None, "N/A") and str(node) != affinity.get(index)
    }
    report = {
        "gpus": len(gpus),
        "unreadable": [f.reason for f in failed],
        "pairs": len(pairs),
        "matrix": ours.matrix(indices),
        "numa": numa,
        "nvidiaSmi": printed,
        "readingSeconds": round(seconds, 4),
        "differ": differ,
        "numaDiffer": numa_differ,
        "verdict": "matrices agree" if not differ and not numa_differ else "matrices differ",
    }
    if len(gpus) < 2:
        report["note"] = "one GPU: no pair to compare; NUMA node compared alone"
    return finish(report, passed="matrices agree")
