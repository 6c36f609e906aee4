"""The expected mix of a cluster's pods (``kubectl inspect gpushare --expected-mix``): every pod on a
gpushared node counted by kind as the extender's cache counts it (``core.placement.mixbook.kind_of``), written as the
document the extender's ``--expected-mix`` reads. Run now and then (a CronJob, or before an upgrade), it
carries what the cluster's workload looks like across extender restarts: a fresh extender counts it
beside the pods it sees, and keeps room for the big kinds that are not running at that moment.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gpushared.contract import ResourceNames
from gpushared.core.placement.cpu import cpu_of, holds_cpu
from gpushared.core.placement.fragmentation import ModelKind
from gpushared.core.placement.mixbook import EXPECTED_WEIGHT, expected_mix_document, kind_of
from gpushared.core.shared.bodies import gpu_models, node_of
from gpushared.core.shared.ledger import holding_from_pod
from gpushared.inspect.view import gpushared_nodes
from gpushared.kube.api import Api


def collect_mix(
    api: Api, *, resources: ResourceNames, model_label: str, weight: float = EXPECTED_WEIGHT
) -> tuple[dict[str, Any], list[str]]:
    """(the expected-mix document, warnings): the pods that hold CPU on gpushared nodes, by kind."""
    warnings: list[str] = []
    units = {
        body["metadata"]["name"]: inventory.unit
        for body, inventory in gpushared_nodes(api.list_nodes(), resources, warnings)
    }
    kinds: Counter[ModelKind] = Counter()
    for pod in api.list_pods():
        unit = units.get(node_of(pod))
        if unit is None or not holds_cpu(pod):
            continue
        holding = holding_from_pod(pod, unit=unit, resources=resources)
        if holding is not None and holding.problem:
            warnings.append(f"pod {holding.namespace}/{holding.name}: {holding.problem}; counted at its spec amounts")
        kinds[kind_of(cpu_of(pod), holding, gpu_models(pod, model_label))] += 1
    return expected_mix_document(kinds, weight=weight), warnings
