"""Callers that are not kube-scheduler."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from faultsuite.harness import World
from faultsuite.scenarios.breaker import Breaker
from tests.builders import GPU_MEM, pod
from tests.extender_harness import Extender


class Hostile(Breaker):
    """Callers that are not kube-scheduler, from the start of the load to its end (and for 10 s at least):
    bodies that once stalled or crashed the extender, generated junk, and binds without a client
    certificate."""

    def __init__(self, world: World, total: int) -> None:
        super().__init__(world, total)
        self.broken = True
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._attack, daemon=True)
        self.thread.start()

    def progress(self, done: int) -> None:
        pass

    def mend(self) -> None:
        time.sleep(max(0.0, 10 - (time.monotonic() - self.started)))
        self.stop.set()
        self.thread.join()

    def _attack(self) -> None:
        rng = random.Random(5)
        stranger = [
            Extender(api=None, workdir=self.world.work, port=r.port, ca=self.world.pki.cert)
            for r in self.world.replicas
        ]
        trusted = self.world.replicas
        sent = 0
        while not self.stop.is_set():
            huge = pod("huge", 1)
            huge["spec"]["containers"][0]["resources"] = {"limits": {GPU_MEM: rng.choice(["1e999999", "9" * 70])}}
            junk: dict[str, Any] = pod("junk", 1)
            junk["spec"]["containers"] = rng.choice(["main", ["main"], [{"resources": []}], 7])
            target = rng.choice(self.world.api.objects("pods"))
            forged_bind = {
                "PodName": target["metadata"]["name"],
                "PodNamespace": "default",
                "PodUID": target["metadata"]["uid"],
                "Node": rng.choice(self.world.nodes),
            }
            with self.world.lock:  # counted from the API server at the end: is the pod bound where it asked?
                self.world.forged_binds.setdefault(forged_bind["PodName"], forged_bind["Node"])
            for replica, body, verb in (
                (rng.choice(trusted), {"Pod": huge, "NodeNames": self.world.nodes}, "filter"),
                (rng.choice(trusted), {"Pod": pod("many", 1), "NodeNames": ["n"] * 20_000}, "filter"),
                (rng.choice(trusted), {"Pod": junk, "NodeNames": self.world.nodes}, "prioritize"),
                (rng.choice(trusted), {**forged_bind, "PodName": "../../nodes/x"}, "bind"),
                (rng.choice(stranger), forged_bind, "bind"),
            ):
                status, result = replica.post(verb, body)
                sent += 1
                if verb == "bind" and status == 200 and isinstance(result, dict) and result.get("Error") == "":
                    self.notes.append(f"a bind without a certificate was answered as done: {forged_bind}")
                if status >= 500 and status != 503:
                    with self.world.lock:
                        self.world.server_errors.append(f"hostile {verb} answered {status}")
            time.sleep(0.05)
        self.notes.append(f"{sent} hostile requests")
