"""The scenarios, by the name the table and --only use: one module each, a Breaker each."""

from __future__ import annotations

from collections.abc import Callable

from faultsuite.harness import World
from faultsuite.scenarios.bindings import Bindings
from faultsuite.scenarios.breaker import Breaker
from faultsuite.scenarios.churn import BindingsUnderChurn
from faultsuite.scenarios.extender_kill import ExtenderKill
from faultsuite.scenarios.failover import WaitingAtFailover
from faultsuite.scenarios.forged import Forged
from faultsuite.scenarios.hostile import Hostile
from faultsuite.scenarios.inflight import BindingInFlight
from faultsuite.scenarios.poisoned import Poisoned
from faultsuite.scenarios.watch_cut import WatchCut
from faultsuite.scenarios.watch_gone import Watch410
from faultsuite.scenarios.watch_stalled import WatchStalled

SCENARIOS: dict[str, Callable[[World, int], Breaker]] = {
    "baseline": Breaker,
    "watch stalled (open, silent)": WatchStalled,
    "watch cut": WatchCut,
    "watch 410 Gone": Watch410,
    "Bindings answered 500": lambda w, n: Bindings(w, n, status=500),
    "Bindings cut, not applied": lambda w, n: Bindings(w, n, cut=True),
    "Bindings applied, answer cut": lambda w, n: Bindings(w, n, cut=True, applied=True),
    "Bindings applied, answered after the client gave up": lambda w, n: Bindings(
        w, n, applied=True, delay=10.5, status=504
    ),
    "Bindings slow (3 s)": lambda w, n: Bindings(w, n, delay=3.0),
    "Bindings answered 500 under watch churn": BindingsUnderChurn,
    "extender kill -9 and restart": lambda w, n: ExtenderKill(w, n, leader=False),
    "leader kill -9": lambda w, n: ExtenderKill(w, n, leader=True),
    "leader kill -9 with a Binding in flight": lambda w, n: BindingInFlight(w, n, stop=False),
    "leader SIGSTOP with a Binding in flight": lambda w, n: BindingInFlight(w, n, stop=True),
    "restart with 100 pods waiting": lambda w, n: WaitingAtFailover(w, n, takeover=False),
    "takeover with 100 pods waiting": lambda w, n: WaitingAtFailover(w, n, takeover=True),
    "hostile callers": Hostile,
    "forged annotations": Forged,
    "poisoned annotations on create and edit": Poisoned,
}
