"""A warm prioritize in-process: every rank already kept, the cost of the lookups and the scores alone.

The cluster of ``bench_extender.py`` (1,000 nodes, 20,000 running pods, binpack), forty pending pods
priced once, then each prioritized against its own 1,000-name sample: the p50 and max of the forty calls,
twice. ``docs/benchmarks.md`` ("Prioritize with the pods seen pending first") quotes it; run it from the
root of each tree compared (``PYTHONPATH=<tree>`` for a worktree):

    .venv/bin/python scripts/bench_prioritize_warm.py
"""

from __future__ import annotations

import gc
import random
import time
from typing import cast

import bench_extender as bench

from gpushared import contract
from gpushared.core.placement.policies import BINPACK
from gpushared.extender.cache import ClusterCache
from gpushared.extender.http.wire import ExtenderArgs
from gpushared.extender.scheduler import Scheduler
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.api import Api, connect
from tests.fakes.apiserver import FakeApiServer

CALLS = 40


def main() -> None:
    rng = random.Random(42)
    with FakeApiServer(history=1_000_000) as api:
        backend = bench.FakeBackend(api)
        names = bench.populate(backend, nodes=1000, pods=20000, rng=rng)
        client = Api(connect(backend.kubeconfig))
        cache = ClusterCache(
            list_nodes=client.rest.lister("/api/v1/nodes", what="nodes"),
            list_pods=client.rest.lister("/api/v1/pods", what="pods"),
            resources=contract.DEFAULT_RESOURCES,
            rooms=BINPACK.reads_rooms,
        )
        cache.start()
        try:
            cache.nodes.wait_synced(600)
            cache.pods.wait_synced(600)
            cache.prepare()  # this thread owns the cache: what was listed is applied here
            time.sleep(1)
            gc.collect()
            gc.freeze()  # as the extender does once synced
            # prioritize never calls the API: no client needed
            scheduler = Scheduler(
                cache=cache,
                api=cast(AsyncApi, None),
                policy=BINPACK,
                resources=contract.DEFAULT_RESOURCES,
                rank_in_filter=False,
            )
            bodies = [bench.pending_body(f"warm-{i}", rng) for i in range(CALLS)]
            for body in bodies:  # every size priced on every node once
                scheduler.prioritize(ExtenderArgs(pod=body, node_names=names, nodes=None))
            calls = [(body, rng.sample(names, 1000)) for body in bodies]
            for _ in range(2):
                seconds = []
                for body, sample in calls:
                    started = time.perf_counter()
                    scheduler.prioritize(ExtenderArgs(pod=body, node_names=sample, nodes=None))
                    seconds.append(time.perf_counter() - started)
                seconds.sort()
                print(f"warm prioritize of 1,000 nodes: p50 {1000 * seconds[CALLS // 2]:.3f} ms, "
                      f"max {1000 * seconds[-1]:.3f} ms")  # fmt: skip
        finally:
            cache.stop()


if __name__ == "__main__":
    main()
