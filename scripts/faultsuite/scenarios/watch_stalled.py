"""The pod watch stays open and goes silent."""

from __future__ import annotations

import time

from faultsuite.scenarios.breaker import Breaker


class WatchStalled(Breaker):
    def break_(self) -> None:
        self.world.api.stall_watches()
        time.sleep(8)  # past --watch-seconds + its grace (5 + 10 s from the start of the last watch)

    def mend(self) -> None:
        self.world.api.stall_watches(False)
