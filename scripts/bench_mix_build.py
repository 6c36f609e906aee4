"""What building one request mix costs where every node class has a shape of its own (issue #56's whole-node
kinds): ``built_mix``, as the extender runs it off its event loop, over ``--classes`` node classes (allocatable
CPU differing node by node, 1-8 GPUs) and ``--kinds`` one-GPU kinds, with and without the kinds a mix with no
expected one assumes (``UNSEEN_WEIGHT``). Prints JSON: seconds per build, the best of ``--repeat``.

    .venv/bin/python scripts/bench_mix_build.py --classes 5000 --kinds 400
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpushared.core.placement.fragmentation import NodeClass
from gpushared.core.placement.mixbook import UNSEEN_WEIGHT, built_mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=5000)
    parser.add_argument("--kinds", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    nodes = {
        NodeClass(model=f"M{i % 7}", gpus=1 + i % 8, gpu_memory=16, cpu=1000 * (args.classes - i) + (i % 8) * 10**7): 1
        for i in range(args.classes)
    }
    kinds = {(1000 * (i % 50), 4 + i % 12, 1, None): 3.0 for i in range(args.kinds)}
    seconds = {}
    for unseen in (0.0, UNSEEN_WEIGHT):
        runs = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            built_mix(kinds, nodes=nodes, rooms=None, unseen=unseen)
            runs.append(time.perf_counter() - started)
        seconds[f"unseen={unseen}"] = round(min(runs), 3)
    print(json.dumps({"classes": args.classes, "kinds": args.kinds, "seconds": seconds}))


if __name__ == "__main__":
    main()
