"""The pod watch is cut."""

from __future__ import annotations

import time

from faultsuite.scenarios.breaker import Breaker


class WatchCut(Breaker):
    def break_(self) -> None:
        for _ in range(10):
            self.world.api.cut_watches()
            time.sleep(0.3)
