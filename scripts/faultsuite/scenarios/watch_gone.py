"""The pod watch answers 410 Gone."""

from __future__ import annotations

import time

from faultsuite.scenarios.breaker import Breaker


class Watch410(Breaker):
    def break_(self) -> None:
        for _ in range(5):
            self.world.api.compact()
            self.world.api.expire_watches()
            time.sleep(0.5)
