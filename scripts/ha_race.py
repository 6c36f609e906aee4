"""Why the extender elects a leader: two active replicas without election, under the HA test's load.

Runs the same schedule as tests/integration/test_extender_ha.py (16 threads, 2,000 pods, 200 nodes) against
two extender processes that both bind, and prints how many GPUs end up over capacity. With
``--leader-elect`` (what deploy/ ships) the count is 0; without it, two caches race for the same memory.

    .venv/bin/python scripts/ha_race.py [--leader-elect] [--seed 3]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.extender_harness import Extender, gpu_node
from tests.fakes.apiserver import FakeApiServer
from tests.integration.test_extender_ha import NODES, over_capacity, schedule_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leader-elect", action="store_true")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(7)
    work = Path(tempfile.mkdtemp(prefix="gps-ha-"))
    extra = ["--leader-elect", "--lease-namespace", "default", "--lease-seconds", "3"] if args.leader_elect else []
    with FakeApiServer(history=100_000) as api:
        for i in range(NODES):
            api.create(gpu_node(f"node-{i:03d}", *[rng.choice((8, 12, 16, 24)) for _ in range(rng.randint(1, 4))]))
        replicas = [Extender(api=api, workdir=work, name=n, args=extra).start() for n in ("a", "b")]
        try:
            for replica in replicas:
                replica.wait_ready(60)
            counts = schedule_all(api, replicas, seed=args.seed)
            problems = over_capacity(api)
        finally:
            for replica in replicas:
                replica.stop()
    print(json.dumps({"leader_elect": args.leader_elect, **counts, "gpus_over_capacity": len(problems)}))


if __name__ == "__main__":
    main()
