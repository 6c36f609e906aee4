"""Faults on Bindings: 500s, cut connections, answers lost or late, slow API server."""

from __future__ import annotations

from typing import Any

from faultsuite.harness import World
from faultsuite.scenarios.breaker import Breaker
from tests.fakes.apiserver import Fault


class Bindings(Breaker):
    """A fault on the Bindings of pods whose names end in one of ``digits``, while broken."""

    def __init__(self, world: World, total: int, **fault: Any) -> None:
        super().__init__(world, total)
        self.fault = Fault(method="POST", path=r"/pods/p-\d*[37]/binding$", times=None, **fault)

    def break_(self) -> None:
        self.world.api.inject(self.fault)

    def mend(self) -> None:
        self.world.api.faults.remove(self.fault)
        self.notes.append(f"{self.fault.hits} Bindings hit")
