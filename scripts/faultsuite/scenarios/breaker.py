"""What every scenario is: something broken when the load reaches one point and mended at another."""

from __future__ import annotations

from faultsuite.harness import World


class Breaker:
    """Breaks the world when the load reaches ``at`` pods, mends it at ``until``; ``notes`` say what it did."""

    def __init__(self, world: World, total: int) -> None:
        self.world, self.total = world, total
        self.notes: list[str] = []
        self.broken = self.mended = False

    def progress(self, done: int) -> None:
        if not self.broken and done >= self.total * 0.2:
            self.broken = True
            self.break_()
        elif self.broken and not self.mended and done >= self.total * 0.6:
            self.mended = True
            self.mend()

    def break_(self) -> None: ...

    def mend(self) -> None: ...

    def finish(self) -> None:
        if not self.mended:
            self.mended = True
            self.mend()
