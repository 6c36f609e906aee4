"""A replica, or the leader, killed with SIGKILL and started again."""

from __future__ import annotations

from faultsuite.harness import World
from faultsuite.scenarios.breaker import Breaker


class ExtenderKill(Breaker):
    def __init__(self, world: World, total: int, *, leader: bool) -> None:
        super().__init__(world, total)
        self.leader = leader

    def break_(self) -> None:
        victim = self.world.leader() if self.leader else self.world.replicas[0]
        victim = victim or self.world.replicas[0]
        self.world.kill(victim)
        self.notes.append(f"killed replica {victim.name} with SIGKILL")
        self.victim = victim
        if not self.leader:
            self.world.restart(victim)

    def mend(self) -> None:
        if self.leader:
            self.world.restart(self.victim)
