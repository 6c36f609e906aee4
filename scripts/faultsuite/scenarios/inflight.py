"""A Binding held at the API server while its extender dies or stops."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from faultsuite.harness import World, wait
from faultsuite.scenarios.breaker import Breaker
from tests.builders import pod
from tests.extender_harness import Extender
from tests.fakes.apiserver import Fault


class BindingInFlight(Breaker):
    """A Binding held at the API server while its extender dies. The suite binds pod ``inflight`` to a node
    with one GPU, as large as the GPU's free memory, through the leader, with that Binding held 6 s and then
    applied; while it is held the leader is killed (kill -9, started again at once) or stopped (SIGSTOP
    for 8 s: the follower takes the Lease meanwhile). Then it asks the new leader to bind a pod of the same
    size to the same node, as kube-scheduler would once the node looks free again. Before the fence the
    new leader bound it, and the first Binding landed on top: 20/16 GiB."""

    def __init__(self, world: World, total: int, *, stop: bool) -> None:
        super().__init__(world, total)
        self.stop = stop

    def break_(self) -> None:
        world = self.world
        leader = world.leader() or world.replicas[0]
        node, room = self._node_with_room(leader)
        if node is None:
            self.notes.append("no node with room: nothing held")
            return
        first = world.api.create(pod("inflight", room))
        second = world.api.create(pod("inflight-again", room))
        fault = Fault(method="POST", path=r"/pods/inflight/binding$", delay=6.0, times=1)
        world.api.inject(fault)
        answer: list[Any] = []
        threading.Thread(target=lambda: answer.append(leader.bind(first, node)), daemon=True).start()
        wait(lambda: fault.hits > 0 or answer, 30, "the Binding held at the API server")
        if not fault.hits:
            self.notes.append(f"the leader did not write the Binding: {answer}")
            return
        assert leader.process is not None
        if self.stop:
            world.stopped.add(leader.name)
            leader.process.send_signal(signal.SIGSTOP)
            self.notes.append(f"stopped leader {leader.name} (SIGSTOP) with a Binding of {room} GiB to {node} held")
        else:
            world.kill(leader)
            self.notes.append(f"killed leader {leader.name} (SIGKILL) with a Binding of {room} GiB to {node} held")
            world.restart(leader)
        held_until = time.monotonic() + 6.5
        other = next(r for r in world.replicas if r is not leader)
        # kube-scheduler trying the same room again once someone leads: the follower once the Lease (3 s) is
        # its own, or the killed leader started again, whichever takes it
        wait(lambda: world.leader() not in (None, leader) or not self.stop, 15, "a new leader")
        deadline_at = max(held_until, time.monotonic() + 2)
        answers = []
        while time.monotonic() < deadline_at:
            replica = world.leader() or other
            status, result = replica.bind(second, node)
            answers.append((status, (result or {}).get("Error", "") if isinstance(result, dict) else result))
            if status == 200 and result == {"Error": ""}:
                with world.lock:
                    world.told["inflight-again"] = node
                break
            time.sleep(0.3)
        fenced = sum(1 for _, error in answers if "may still have in flight" in str(error))
        self.notes.append(f"the second bind was refused {fenced} times as fenced; last answer {answers[-1:]}")
        time.sleep(max(0.0, deadline_at - time.monotonic()))  # the held Binding has landed by now
        if self.stop:
            leader.process.send_signal(signal.SIGCONT)
            world.stopped.discard(leader.name)
        where = {
            name: (world.api.get("pods", name, "default") or {}).get("spec", {}).get("nodeName")
            for name in ("inflight", "inflight-again")
        }
        self.notes.append(f"then: {where}")

    def _node_with_room(self, leader: Extender) -> tuple[str | None, int]:
        """A node with one GPU and free memory on it, as the leader counts it (its binds included): the held
        Binding and a second pod of its size can only go to that GPU."""
        for name, inventory in sorted(self.world.inventories.items(), key=lambda item: len(item[1].gpus)):
            if len(inventory.gpus) != 1:
                continue
            status, report = leader.inspect(name)
            if status != 200:
                continue
            [gpu] = report["nodes"][0]["devs"]
            room = gpu["totalGPU"] - gpu["usedGPU"]
            if room > 0:
                return name, room
        return None, 0
