"""What a scenario left, counted from the API server's objects, never from the extenders' books or answers."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from faultsuite.harness import World
from gpushared import contract
from gpushared.contract import MemoryUnit
from gpushared.core.shared.ledger import Ledger, holding_from_pod


@dataclass
class Outcome:
    scenario: str
    pods: int = 0
    bound: int = 0
    over_capacity: list[str] = field(default_factory=list)
    bound_without_allocation: list[str] = field(default_factory=list)
    annotated_but_unbound: list[str] = field(default_factory=list)
    lost_binds: list[str] = field(default_factory=list)
    unauthenticated_binds: list[str] = field(default_factory=list)
    #: verbs answered 500 or worse (a caller's bad input gets 4xx or an error in the body, never that)
    server_errors: list[str] = field(default_factory=list)
    #: /healthz probes of a running replica that failed or took longer than PROBE_TIMEOUT
    healthz_failures: list[str] = field(default_factory=list)
    #: the scenario did not finish within --deadline
    hung: bool = False
    #: what the pods asked for over what the cluster's GPUs hold
    demand_ratio: float = 0.0
    healthz_max_ms: float = 0.0
    #: the longest either extender's event loop was held (its own probe): what blocks /healthz
    loop_lag_max_ms: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: a failover with pods waiting: seconds from Ready (or the takeover) to the first bind and to the last
    #: fitting pod's, and the pods bound of those waiting, as the API server's objects show them
    recovery: dict[str, float] = field(default_factory=dict)
    #: what broke the promise of the failover scenarios (first bind within 5 s, every fitting pod in 30 s)
    outage: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (
            self.outage
            or self.over_capacity
            or self.bound_without_allocation
            or self.annotated_but_unbound
            or self.lost_binds
            or self.unauthenticated_binds
            or self.server_errors
            or self.healthz_failures
            or self.hung
        )


def count(world: World, outcome: Outcome) -> None:
    pods = {p["metadata"]["name"]: p for p in world.api.objects("pods")}
    outcome.bound = sum(1 for p in pods.values() if p["spec"].get("nodeName"))
    by_node: dict[str, list[dict[str, Any]]] = {}
    for name, body in pods.items():
        node = body["spec"].get("nodeName")
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        if node and contract.POD_ALLOCATION not in annotations and name not in world.bypassed:
            outcome.bound_without_allocation.append(name)
        if not node and contract.POD_ALLOCATION in annotations and name not in world.bypassed:
            outcome.annotated_but_unbound.append(name)
        if name in world.told and world.told[name] != node:
            outcome.lost_binds.append(f"{name}: told {world.told[name]}, is on {node}")
        if node:
            truth = copy.deepcopy(body)
            if name in world.written:  # where its containers run: what its Binding wrote
                truth["metadata"]["annotations"] = world.written[name]
            by_node.setdefault(node, []).append(truth)
    for node in world.api.objects("nodes"):
        name = node["metadata"]["name"]
        # the GPUs as the node's daemon found them (a scenario may forge the annotation on the API server)
        inventory = world.inventories.get(name) or contract.parse_inventory(
            node["metadata"]["annotations"][contract.NODE_INVENTORY]
        )
        ledger = Ledger.build(inventory)
        for body in by_node.get(name, []):
            holding = holding_from_pod(body, unit=MemoryUnit.GIB)  # type: ignore[arg-type]
            if holding is not None:
                ledger.add(holding)
        outcome.over_capacity += [
            f"{name} GPU {g.index}: {ledger.used(g.index)}/{g.memory}"
            for g in inventory.gpus
            if ledger.used(g.index) > g.memory
        ]
    outcome.unauthenticated_binds = [
        f"{name} -> {node}"
        for name, node in world.forged_binds.items()
        if (pods.get(name) or {}).get("spec", {}).get("nodeName") == node and world.told.get(name) != node
    ]
    outcome.server_errors = list(world.server_errors)
