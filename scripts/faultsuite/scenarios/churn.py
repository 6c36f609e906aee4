"""Bindings answered 500 while every watch is cut, again and again."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from faultsuite.harness import World, schedule
from faultsuite.scenarios.bindings import Bindings
from tests.builders import GPU_MEM, pod


class BindingsUnderChurn(Bindings):
    """Bindings answered 500 while every watch is cut, again and again, for ``--churn-seconds``: the event
    loop settling binds and the pod informer applying events once deadlocked each other here (30-42 s in, 2
    of 2 runs). Throughout, a few bound pods are deleted each round and as many of the same sizes created
    and scheduled, so Bindings (a fifth of them answered 500), their read-backs, relists and deletions keep
    meeting on the extender's loop for as long as the window lasts (issue #40 runs it for minutes). The
    fault is mended only when the churn ends."""

    def __init__(self, world: World, total: int) -> None:
        super().__init__(world, total, status=500)
        self._churning = threading.Thread(target=self._churn, name="churn", daemon=True)
        self.rounds = self.deleted = self.left_waiting = 0

    def break_(self) -> None:
        super().break_()
        self._churning.start()

    def mend(self) -> None:
        if self._churning.ident is not None:  # started by break_
            self._churning.join()
        super().mend()
        self.notes.append(
            f"{self.rounds} rounds in {self.world.args.churn_seconds:g} s: watches cut, "
            f"{self.deleted} bound pods deleted and as many created and scheduled ({self.left_waiting} of those "
            "still waiting for room at the end)"
        )

    def _churn(self) -> None:
        from kubernetes import client

        world = self.world
        core = client.CoreV1Api(world.api.client())
        rng = random.Random(world.args.seed)
        ends = time.monotonic() + world.args.churn_seconds
        waiting: list[dict[str, Any]] = []
        while time.monotonic() < ends:
            world.api.cut_watches()
            bound = [
                p
                for p in world.api.objects("pods")
                if p["spec"].get("nodeName") and p["metadata"]["name"] in world.told
            ]
            fresh = []
            for body in rng.sample(bound, min(CHURN_PODS, len(bound))):
                name = body["metadata"]["name"]
                core.delete_namespaced_pod(name, "default")
                with world.lock:
                    world.told.pop(name, None)
                    world.written.pop(name, None)
                self.deleted += 1
                size = sum(int(c["resources"]["limits"][GPU_MEM]) for c in body["spec"]["containers"])
                # digits only after "p-", the round's last: a fifth of these Bindings are answered 500 too
                fresh.append(world.api.create(pod(f"p-8{len(fresh)}{self.rounds:05d}", size)))
            # as kube-scheduler does, a pod that found no room yet (its predecessor's deletion not seen, a
            # Binding answered 500 still reserved) is tried again in the next rounds
            waiting = [*waiting, *fresh]
            schedule(world, waiting, threads=CHURN_PODS, progress=lambda _: None)
            waiting = [b for b in waiting if b["metadata"]["name"] not in world.told]
            self.rounds += 1
            time.sleep(0.3)
        self.left_waiting = len(waiting)


#: Bound pods deleted, and pods of their sizes created and scheduled, per round of the churn.
CHURN_PODS = 3
