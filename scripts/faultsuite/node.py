"""The node daemon's scenario: counted from what the kubelet got."""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultsuite.harness import Hung, deadline, wait
from faultsuite.scenarios.poisoned import POISONS
from gpushared import contract
from tests.builders import pod
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.harness import NODE


@dataclass
class NodeOutcome:
    scenario: str
    containers: int = 0
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    wrong_gpu: list[str] = field(default_factory=list)
    #: GPUs given more memory than they have, summed from what the kubelet's containers were given
    over_capacity: list[str] = field(default_factory=list)
    #: pods annotated for a GPU without room (as a broken or forged placement would) that got it anyway
    overcommits_admitted: list[str] = field(default_factory=list)
    overcommits_tried: int = 0
    #: times the daemon process exited (poisoned pods once crash-looped it)
    daemon_exits: int = 0
    #: forged inventories still on the Node 5 s after the edit
    forgeries_left: list[str] = field(default_factory=list)
    #: connections to the metrics port held open while Allocate went on
    connections_held: int = 0
    hung: bool = False
    allocate_max_ms: float = 0.0
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (
            self.wrong_gpu
            or self.over_capacity
            or self.overcommits_admitted
            or self.daemon_exits
            or self.forgeries_left
            or self.hung
        )


def run_node_within(args: argparse.Namespace, work: Path) -> NodeOutcome:
    outcome = NodeOutcome(scenario=NODE_SCENARIO)
    started = time.monotonic()
    try:
        with deadline(args.deadline):
            run_node(args, work, outcome)
    except Hung:
        outcome.hung = True
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


NODE_SCENARIO = (
    "node daemon: API server hang during Allocate, NVML error on GPU 3, poisoned pods, 3,000 idle connections, "
    "a forged inventory, over-commits"
)


def run_node(args: argparse.Namespace, work: Path, outcome: NodeOutcome) -> None:
    """One node (4 fake GPUs of 16, 12, 24 and 8 GiB; the daemon under systemd's default limit of 1,024
    descriptors) and pods placed on it as the extender places them, each admitted right after its bind, one
    at a time as the kubelet does. Before the load, pods with poisoned annotations are created on the node.
    A quarter of the way in, the API server hangs for pod reads and the daemon's pod watch stalls (each call
    must answer within its 2 s budget), and 3,000 connections to the metrics port are opened and held;
    half-way, that ends and GPU 3 fails in NVML (GPU_IS_LOST) until three quarters, when someone inflates
    GPU 3 in the node's inventory annotation. Then every refused pod is admitted again, and pods annotated
    for GPUs without room are admitted (an over-commit attempt: each must be refused).

    Counts, from what the kubelet got: containers given another GPU than their allocation names, GPUs
    given more than they have, over-commits admitted; and daemon exits, forgeries still there 5 s on."""
    import socket

    with node_world(work, launcher=["prlimit", "--nofile=1024:1024", "--"]) as daemon:
        plan = plan_for_node(args)
        node = NodeAdmissions(daemon, outcome)
        quarter = max(1, len(plan) // 4)
        hang = Fault(method="GET", path=r"/pods/n-\d+$", delay=30.0, times=None)
        gpu_mem = contract.DEFAULT_RESOURCES.gpu_mem
        for i, (key, value) in enumerate(POISONS.items()):
            daemon.api.create(pod(f"poisoned-{i}", 1 + i % 2, node=NODE, annotations={key: value}))
        held: list[socket.socket] = []
        for i, (amount, gpu) in enumerate(plan):
            if i == quarter:
                daemon.api.stall_watches()
                daemon.api.inject(hang)
                held = hold_connections(daemon.metrics_port, 3000)
                outcome.connections_held = len(held)
            elif i == 2 * quarter:
                daemon.api.faults.remove(hang)
                daemon.api.stall_watches(False)
                for connection in held:
                    connection.close()
                daemon.nvml.gpus[3].errors = {"nvmlDeviceGetMemoryInfo": "GPU_IS_LOST"}
                daemon.nvml.write()
                daemon.kubelet.wait_for(gpu_mem, capacity=52)
            elif i == 3 * quarter:
                daemon.nvml.gpus[3].errors = {}
                daemon.nvml.write()
                daemon.kubelet.wait_for(gpu_mem, capacity=60, timeout=30)
                forge_inventory(daemon, outcome)
            # bound just now, as the extender binds: while the watch is stalled the daemon must read it
            node.admit(daemon.place(f"n-{i:03d}", amount, gpu=gpu), gpu)
        node.admit_refused_again()
        node.overcommit()
        outcome.containers = len(plan)
        outcome.allocate_max_ms = round(max((t for _, t in daemon.kubelet.timings), default=0.0) * 1000, 1)
        outcome.over_capacity = node.over_capacity()
        if daemon.process is not None and daemon.process.poll() is not None:
            outcome.daemon_exits += 1


def hold_connections(port: int, count: int) -> list[Any]:
    """``count`` TCP connections to ``port`` opened and left idle (those the daemon closes at once too)."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 4096), hard))
    held = []
    for _ in range(count):
        connection = socket.socket()
        connection.settimeout(0.5)
        try:
            connection.connect(("127.0.0.1", port))
        except OSError:
            connection.close()
            continue
        held.append(connection)
    return held


def forge_inventory(daemon: Any, outcome: NodeOutcome) -> None:
    """Someone inflates GPU 3 (8 GiB) to 80 in the Node's inventory annotation; the daemon's must be back
    within 5 s."""
    from kubernetes import client

    ours = daemon.inventory_annotations()[contract.NODE_INVENTORY]
    inflated = json.loads(ours)
    inflated["gpus"][3]["memory"], inflated["gpus"][3]["memoryMiB"] = 80, 80 * 1024
    core = client.CoreV1Api(daemon.api.client())
    core.patch_node(NODE, {"metadata": {"annotations": {contract.NODE_INVENTORY: json.dumps(inflated)}}})
    deadline_at = time.monotonic() + 5
    while time.monotonic() < deadline_at:
        shown = json.loads(daemon.inventory_annotations()[contract.NODE_INVENTORY])
        if shown["gpus"][3]["memory"] == 8:
            return
        time.sleep(0.1)
    outcome.forgeries_left.append("GPU 3 still 80 GiB in the inventory 5 s after the edit")


@contextmanager
def node_world(work: Path, *, launcher: list[str] | None = None) -> Iterator[Any]:
    """The daemon serving, registered with the fake kubelet, its inventory on the Node."""
    from tests.fakes.kubelet import FakeKubelet
    from tests.fakes.nvml import FakeNvml, build_library
    from tests.fakes.systemd import NotifySocket
    from tests.harness import Daemon, node_body

    work.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gps-", dir="/tmp"))  # short: unix socket paths
    (root / "device-plugins").mkdir()
    library = build_library(work / "fake-nvml")
    with FakeApiServer() as api, FakeKubelet(root, seed=1) as kubelet:
        api.create(node_body())
        notify = NotifySocket(root / "notify.sock")
        nvml = FakeNvml.with_sizes(work / "nvml.json", library, 16384, 12288, 24576, 8192)
        daemon = Daemon(api=api, kubelet=kubelet, nvml=nvml, notify=notify, workdir=work)
        daemon.launcher = launcher or []
        daemon.start()
        try:
            notify.wait_for("READY=1")
            kubelet.wait_for(contract.DEFAULT_RESOURCES.gpu_mem, capacity=60)
            wait(lambda: contract.NODE_INVENTORY in daemon.inventory_annotations(), 30, "inventory")
            yield daemon
        finally:
            if daemon.process is not None and daemon.process.poll() is None:
                daemon.stop()
            notify.close()


def plan_for_node(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(amount, GPU) of pods of 1-3 GiB on random GPUs with room, as the extender would place them, up to
    three quarters of the node: the rest is room for the over-commit attempts to be the daemon's to refuse
    (the kubelet's own count of devices refuses what the node as a whole has no room for)."""
    rng = random.Random(args.seed)
    room = {0: 16, 1: 12, 2: 24, 3: 8}
    plan = []
    for _ in range(args.node_pods):
        amount = rng.randint(1, 3)
        fits = [g for g, free in room.items() if free >= amount]
        if not fits or sum(room.values()) - amount < 15:
            break
        gpu = rng.choice(fits)
        room[gpu] -= amount
        plan.append((amount, gpu))
    return plan


class NodeAdmissions:
    """The kubelet's admissions, checked: every container on the GPU its allocation names."""

    def __init__(self, daemon: Any, outcome: NodeOutcome) -> None:
        self.daemon, self.outcome = daemon, outcome
        self.uuids = [g.uuid for g in daemon.nvml.gpus]
        self.refused: list[tuple[dict[str, Any], int]] = []
        #: (GPU UUID, GiB) of every container the kubelet was given a GPU for
        self.answers: list[tuple[str, int]] = []

    def admit(self, body: dict[str, Any], gpu: int) -> None:
        from tests.fakes.kubelet import AdmissionError

        name = body["metadata"]["name"]
        try:
            allocations = self.daemon.admit(body)
        except AdmissionError as exc:
            found = re.search(r"\b([A-Z][A-Z_]{4,}):", str(exc))  # the gRPC status the daemon answered
            code = found[1] if found else "kubelet: " + str(exc)[:40]
            self.outcome.refused[code] = self.outcome.refused.get(code, 0) + 1
            self.refused.append((body, gpu))
            # The kubelet marks a pod it rejected Failed and drops it from its pod manager (the daemon refuses
            # to guess while a rejected pod still waits there beside another; design.md §7).
            self.daemon.kubelet.pods.pop(self._uid(body), None)
            return
        self.outcome.admitted += 1
        for allocation in allocations:
            envs = allocation.response.envs
            if envs["NVIDIA_VISIBLE_DEVICES"] != self.uuids[gpu]:
                self.outcome.wrong_gpu.append(f"{name}/{allocation.name}")
            self.answers.append((envs["NVIDIA_VISIBLE_DEVICES"], int(envs[contract.ENV_GPU_MEM_CONTAINER])))

    def overcommit(self) -> None:
        """Pods annotated for each GPU with more than the GPU has left (a broken or forged placement): the
        daemon must refuse every one."""
        free = dict(enumerate((16, 12, 24, 8)))
        for gpu, amount in self.given().items():
            free[gpu] -= amount
        # Only where the node as a whole has room, so the kubelet's own count of devices lets it through and
        # the daemon is the one to refuse.
        for gpu, left in free.items():
            if sum(free.values()) < left + 1:
                continue
            self.outcome.overcommits_tried += 1
            body = self.daemon.place(f"over-{gpu}", left + 1, gpu=gpu)
            before = self.outcome.admitted
            self.admit(body, gpu)
            if self.outcome.admitted > before:
                self.outcome.overcommits_admitted.append(f"over-{gpu}: {left + 1} GiB on GPU {gpu} with {left} left")

    def given(self) -> dict[int, int]:
        """GiB per GPU the kubelet's containers were given, from the answers it got."""
        given: dict[int, int] = {}
        for uuid, amount in self.answers:
            gpu = self.uuids.index(uuid)
            given[gpu] = given.get(gpu, 0) + amount
        return given

    def over_capacity(self) -> list[str]:
        sizes = (16, 12, 24, 8)
        return [f"GPU {gpu}: {amount}/{sizes[gpu]}" for gpu, amount in self.given().items() if amount > sizes[gpu]]

    def admit_refused_again(self) -> None:
        """The pod's controller replaces a refused pod; here the same pod is admitted again."""
        again, self.refused = self.refused, []
        for body, gpu in again:
            self.admit(body, gpu)

    def _uid(self, body: dict[str, Any]) -> str:
        return str((self.daemon.api.get("pods", body["metadata"]["name"], "default") or {})["metadata"]["uid"])
