"""The resource manager's bookkeeping, without sockets."""

from __future__ import annotations

from typing import Any

from gpushared.contract import DEFAULT_RESOURCES, MemoryUnit
from gpushared.daemon.accounting import Served
from gpushared.daemon.health import Health
from gpushared.daemon.manager import Manager
from gpushared.daemon.metrics import DaemonMetrics
from tests.builders import pod


class Pods:
    """Stands in for the node's pod watch: a synced snapshot."""

    synced = True

    def __init__(self, *bodies: dict[str, Any]) -> None:
        self.bodies = list(bodies)

    def pods(self) -> list[dict[str, Any]]:
        return self.bodies


def test_what_was_served_to_departed_pods_is_forgotten() -> None:
    pods = Pods(pod("stays", 1, node="n1"), pod("leaves", 1, node="n1"))
    manager = Manager(
        node="n1",
        resources=DEFAULT_RESOURCES,
        unit=MemoryUnit.GIB,
        api=None,
        pods=pods,  # type: ignore[arg-type]
        pod_resources_socket=None,
        health=Health(ignored_xids=[], recover_after=1),
        metrics=DaemonMetrics(),
    )
    for body in pods.bodies:
        manager.served[body["metadata"]["uid"]] = Served(namespace="default", name=body["metadata"]["name"])
    manager.ledger()
    assert len(manager.accounting._holdings) == 2
    pods.bodies.pop()
    manager.forget_departed()
    assert list(manager.served) == ["uid-default-stays"]
    assert list(manager.accounting._holdings) == ["uid-default-stays"]
