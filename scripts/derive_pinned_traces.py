"""Pod lists with more GPU pods pinned to a GPU model than the published ones: gpuspec30, gpuspec40, gpuspec50.

The published gpuspec lists (5, 10 and 20 % pinned) are the default list with ``gpu_spec`` set on a share of
its GPU pods and nothing else changed (every other column of every row is the default's), each share drawn
apart (gpuspec10's pinned pods are not a superset of gpuspec05's). This derives more of them the same way:

- the rows are the default list's, in its order, every column but ``gpu_spec`` untouched;
- of its GPU pods, ``round(share x count)`` are pinned, drawn at random (``random.Random(seed)``) within each
  kind the published lists pin at different rates (one GPU whole, a share of one GPU, several GPUs), so that
  the derived list pins each kind at the published lists' relative rate, scaled to the share;
- each pinned pod's ``gpu_spec`` is drawn from the values the published lists give pods of its kind, in
  their proportions (pooled over gpuspec05, 10 and 20): the models (and sets of models, ``T4|P100``) pods
  of that kind ask for.

Writes ``--out``: the derived lists beside links to every file of ``--data`` (the node lists, the published
lists, the paper's results), so that ``scripts/bench_openb.py --data OUT`` and ``scripts/tune_placement.py
--data OUT`` replay them as any other trace. The published lists are read, never changed; no other pod list
of the Alibaba repository is used.

    .venv/bin/python scripts/derive_pinned_traces.py --out /var/tmp/gpushared-traces
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_openb import DEFAULT_DATA, POD_LIST

PUBLISHED = ("gpuspec05", "gpuspec10", "gpuspec20")
SHARES = (30, 40, 50)
SEED = 42


def kind_of(row: dict[str, str]) -> str:
    gpus, milli = int(row["num_gpu"] or 0), int(row["gpu_milli"] or 0)
    if gpus > 1:
        return "several"
    return "whole" if milli >= 1000 else "share"


def read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as stream:
        reader = csv.DictReader(stream)
        return list(reader.fieldnames or []), list(reader)


def derive(data: Path, share: int, seed: int) -> tuple[list[str], list[dict[str, str]]]:
    fields, default = read(data / POD_LIST.format("default"))
    rates: dict[str, list[float]] = defaultdict(list)  # kind -> pinned rate per published list
    values: dict[str, Counter[str]] = defaultdict(Counter)
    for name in PUBLISHED:
        _, rows = read(data / POD_LIST.format(name))
        pinned, count = Counter[str](), Counter[str]()
        for row in rows:
            if int(row["num_gpu"] or 0) > 0:
                count[kind_of(row)] += 1
                if row["gpu_spec"]:
                    pinned[kind_of(row)] += 1
                    values[kind_of(row)][row["gpu_spec"]] += 1
        overall = sum(pinned.values()) / sum(count.values())
        for kind in count:
            rates[kind].append(pinned[kind] / count[kind] / overall)  # relative to the list's share
    gpu_rows = [i for i, row in enumerate(default) if int(row["num_gpu"] or 0) > 0]
    by_kind: dict[str, list[int]] = defaultdict(list)
    for i in gpu_rows:
        by_kind[kind_of(default[i])].append(i)
    relative = {kind: sum(r) / len(r) for kind, r in rates.items()}
    # scale the kinds' relative rates so that the pinned pods are share % of the GPU pods
    weight = sum(relative[k] * len(rows) for k, rows in by_kind.items())
    target = round(share / 100 * len(gpu_rows))
    rng = random.Random(seed)
    out = [dict(row, gpu_spec="") for row in default]
    for kind in sorted(by_kind):
        rows = by_kind[kind]
        count = min(len(rows), round(target * relative[kind] * len(rows) / weight))
        population = sorted(values[kind])
        weights = [values[kind][v] for v in population]
        for i in rng.sample(rows, count):
            out[i]["gpu_spec"] = rng.choices(population, weights)[0]
    return fields, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the published traces' directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shares", nargs="*", type=int, default=list(SHARES))
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for source in args.data.iterdir():
        link = args.out / source.name
        if not link.exists():
            link.symlink_to(source.resolve())
    for share in args.shares:
        fields, rows = derive(args.data, share, args.seed)
        path = args.out / POD_LIST.format(f"gpuspec{share}")
        with path.open("w", newline="") as stream:
            writer = csv.DictWriter(stream, fieldnames=fields, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        gpu = [r for r in rows if int(r["num_gpu"] or 0) > 0]
        pinned = sum(1 for r in gpu if r["gpu_spec"])
        print(f"{path}: {pinned} of {len(gpu)} GPU pods pinned ({100 * pinned / len(gpu):.1f} %)")


if __name__ == "__main__":
    main()
