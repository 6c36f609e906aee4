"""100 GPU pods waiting at a restart or a takeover (issue #52, item 10)."""

from __future__ import annotations

import threading
import time

from faultsuite.harness import World, free_gpu_memory, retry_until_bound, wait
from faultsuite.scenarios.breaker import Breaker
from tests.builders import pod
from tests.extender_harness import Extender

#: GPU pods waiting when the replicas restart or the leader is taken over from (issue #52, item 10), and the
#: promise: the first bound within FIRST_BIND_SECONDS of Ready or the takeover, every one that fits within
#: RECOVERY_SECONDS.
WAITING_PODS, FIRST_BIND_SECONDS, RECOVERY_SECONDS = 100, 5.0, 30.0


class WaitingAtFailover(Breaker):
    """``WAITING_PODS`` pods of 1 GiB created, then every replica killed (kill -9) and started again, or the
    leader killed and the follower left to take over; kube-scheduler then binds them, beside the load. Timed
    from the API server's objects (a poll every 50 ms): before issue #52 the fence held every bind for its
    whole window (120 s by default) after a restart or a takeover."""

    def __init__(self, world: World, total: int, *, takeover: bool) -> None:
        super().__init__(world, total)
        self.takeover = takeover
        self.victim: Extender | None = None
        self.recovery: dict[str, float] = {}
        self.outage: list[str] = []

    def break_(self) -> None:
        world = self.world
        waiting = [world.api.create(pod(f"w-{i:03d}", 1)) for i in range(WAITING_PODS)]
        if self.takeover:
            self.victim = leader = world.leader() or world.replicas[0]
            world.kill(leader)
            wait(lambda: world.leader() not in (None, leader), 30, "the follower takes the Lease")
            self.notes.append(f"killed leader {leader.name} with {WAITING_PODS} pods waiting")
        else:
            for replica in world.replicas:
                world.kill(replica)
            killed = time.monotonic()
            for replica in world.replicas:
                world.restart(replica)

            def leading_and_ready() -> bool:
                """A replica says it leads (its gauge: the Lease names the killed processes' ports too)."""
                for replica in world.replicas:
                    status, text = replica.get("/metrics")
                    if status == 200 and b"\ngpushared_extender_leader 1.0" in text:
                        return replica.get("/readyz")[0] == 200
                return False

            # Ready to bind: a replica of the new processes holds the Lease (their identities are new: the
            # killed holder's Lease runs out first) and has synced
            wait(leading_and_ready, 60, "a new leader ready")
            self.notes.append(
                f"killed and restarted both replicas with {WAITING_PODS} pods waiting; a new leader ready "
                f"{time.monotonic() - killed:.1f} s after the kill"
            )
        since = time.monotonic()
        names = {b["metadata"]["name"] for b in waiting}
        seen: dict[str, float] = {}
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                now = time.monotonic()
                for body in world.api.objects("pods"):
                    name = body["metadata"]["name"]
                    if name in names and name not in seen and body["spec"].get("nodeName"):
                        seen[name] = now
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        retry_until_bound(world, waiting, until=since + RECOVERY_SECONDS)
        wait(lambda: len(seen) == len(names) or time.monotonic() > since + RECOVERY_SECONDS, 60, "the waiting pods")
        stop.set()
        watcher.join()
        room = free_gpu_memory(world)
        unbound = sorted(names - seen.keys())
        self.recovery = {
            "first_bind_s": round(min(seen.values()) - since, 2) if seen else -1.0,
            "last_bind_s": round(max(seen.values()) - since, 2) if seen else -1.0,
            "bound": len(seen),
            "waiting": len(names),
        }
        self.notes.append(
            f"first bind {self.recovery['first_bind_s']} s after {'the takeover' if self.takeover else 'it'}, "
            f"{len(seen)}/{len(names)} bound, the last at {self.recovery['last_bind_s']} s"
        )
        if not seen or min(seen.values()) - since > FIRST_BIND_SECONDS:
            self.outage.append(f"first bind {self.recovery['first_bind_s']} s (promise {FIRST_BIND_SECONDS:g})")
        late = [n for n, at in seen.items() if at - since > RECOVERY_SECONDS]
        if (unbound and room) or late:
            self.outage.append(f"{len(unbound)} unbound with {room} GiB free, {len(late)} bound past 30 s")

    def mend(self) -> None:
        if self.victim is not None:
            self.world.restart(self.victim)
