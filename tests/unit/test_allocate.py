"""The daemon's Allocate as a table: the node's pods, the kubelet's call, and what the container gets or why not.

Each row runs what the manager runs between gathering and answering — the handshake names the container
(``core.node.handshake``), ``core.node.allocate.decide`` answers for it — over plain data. Every refusal of
docs/design.md §7 is a row here; the two that depend on I/O (the API server or PodResources unreachable)
are rows of test_allocate_candidates.py, through ``daemon.candidates`` with fakes that fail.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpushared import contract
from gpushared.contract import DEFAULT_RESOURCES, GpuInventory, MemoryUnit
from gpushared.core.node.allocate import ContainerAllocation, MpsDaemon, NodeFacts, Refusal, decide, preferred_devices
from gpushared.core.node.exposure import CDI_KIND, ExposurePolicy, Strategy
from gpushared.core.node.handshake import Unidentified, candidate, identify
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.ledger import Ledger, holding_from_pod
from gpushared.core.shared.requests import pod_request
from gpushared.core.shared.verdicts import MAX_MPS_CLIENTS
from tests.allocating import BIG, INV, MPS_DIRS, MPS_INV, UUID, ids, placed
from tests.builders import inventory, pod


def bound_with_limit(name: str, amount: int, *, gpu: int, limit: str) -> dict[str, Any]:
    """An MPS pod bound to n1 on ``gpu`` of MPS_INV with a compute limit when it was bound."""
    body = pod(name, amount, node="n1", annotations={contract.POD_MPS: "true", contract.POD_COMPUTE_LIMIT: limit})
    body["metadata"]["annotations"].update(
        bind_annotations(pod_request(body), [MPS_INV.gpus[gpu]], unit=MPS_INV.unit, now_ns=1)
    )
    return body


def asking_compute(name: str, amount: int, request: int, *, assigned: bool = False) -> dict[str, Any]:
    """A pod that asked ``request`` percent of its GPU's compute, bound on GPU 0 with that share recorded."""
    body = pod(name, amount, node="n1", annotations={contract.POD_COMPUTE_REQUEST: str(request)})
    body["metadata"]["annotations"].update(bind_annotations(pod_request(body), [INV.gpus[0]], unit=INV.unit, now_ns=1))
    if assigned:
        body["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_ASSIGNED] = "true"
        body["status"]["phase"] = "Running"
    return body


def edited(body: dict[str, Any], **annotations: str) -> dict[str, Any]:
    body["metadata"]["annotations"].update(annotations)
    return body


@dataclass
class Case:
    name: str
    #: the node's pods: those not ASSIGNED wait for devices (none of their containers are listed yet)
    pods: list[dict[str, Any]]
    #: the kubelet's call: the device IDs it gives the container
    devices: list[str]
    inventory: GpuInventory = INV
    exposure: ExposurePolicy = field(default_factory=ExposurePolicy)
    minors: dict[str, int | None] = field(default_factory=lambda: {u: i for i, u in enumerate(UUID)})
    present: tuple[str, ...] = tuple(f"/dev/nvidia{i}" for i in range(8))
    mps: dict[str, MpsDaemon] | None = None
    #: a granted allocation: env that must be in it (others may be too), and its mounts, devices and CDI names
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] | None = None
    devices_given: list[str] | None = None
    cdi: list[str] | None = None
    #: a refusal: a regular expression its message matches, and the pod its Event goes to (None: no Event)
    refused: str | None = None
    event_on: str | None = None


def answer(case: Case) -> ContainerAllocation | Refusal:
    """What the manager answers, minus the I/O: candidates from the pods, the handshake, the decision."""
    ledger = Ledger.build(case.inventory)
    for body in case.pods:
        holding = holding_from_pod(body, unit=case.inventory.unit)
        if holding is not None:
            ledger.add(holding)
    listed = {"c0": [], "c1": []}
    candidates = [
        found
        for body in case.pods
        if (found := candidate(body, listed=listed, served=set(), unit=MemoryUnit.GIB, resources=DEFAULT_RESOURCES))
    ]
    try:
        decision = identify(len(case.devices), candidates, unit=MemoryUnit.GIB, node="n1")
    except Unidentified as exc:
        return Refusal(exc.message, exc.pod)
    facts = NodeFacts(
        name="n1",
        inventory=case.inventory,
        ledger=ledger,
        exposure=case.exposure,
        minors=case.minors,
        present_devices=case.present,
        mps=case.mps,
    )
    return decide(decision.chosen, case.devices, facts)


CASES = [
    # --- granted ------------------------------------------------------------------------------------------
    Case(
        "one container on the GPU its annotation names gets that GPU and Aliyun's env",
        [placed("p", 4, gpus=(1,))],
        ids(1, 4),
        envs={
            "NVIDIA_VISIBLE_DEVICES": UUID[1],
            contract.ENV_GPU_MEM_IDX: "1",
            contract.ENV_GPU_MEM_POD: "4",
            contract.ENV_GPU_MEM_CONTAINER: "4",
            contract.ENV_GPU_MEM_DEV: "16",
        },
        mounts=[],
        devices_given=["/dev/nvidia1"],  # deviceNodes, on by default: runc records it for systemd
        cdi=[],
    ),
    Case(
        "ALIYUN_COM_GPU_MEM_POD is the pod's peak: an init container larger than its app containers counts",
        [placed("p", 2, 3, gpus=(0,), init=[{"name": "warm", "resources": {"limits": {"aliyun.com/gpu-mem": "6"}}}])],
        ids(0, 6),
        envs={contract.ENV_GPU_MEM_POD: "6", contract.ENV_GPU_MEM_CONTAINER: "6"},
    ),
    Case(
        "ALIYUN_COM_GPU_MEM_POD is the pod's peak on several GPUs too, where no _POD annotation is written",
        [placed("train", 16, gpus=(1, 0))],
        ids(1, 8) + ids(0, 8),
        envs={
            "NVIDIA_VISIBLE_DEVICES": f"{UUID[1]},{UUID[0]}",
            contract.ENV_GPU_MEM_IDX: "1,0",
            contract.ENV_GPU_MEM_POD: "16",
            contract.ENV_GPU_MEM_CONTAINER: "16",
        },
    ),
    Case(
        "of equal waiting pods on one GPU, the oldest assume time is taken (either is right)",
        [placed("late", 2, gpus=(2,), at=20), placed("early", 2, gpus=(2,), at=10)],
        ids(2, 2),
        envs={contract.ENV_GPU_MEM_IDX: "2"},
    ),
    Case(
        "a pod already in the ledger (the watch saw its bind) is counted once: 16 of 16 fits",
        [placed("p", 8, gpus=(0,)), placed("full", 8, gpus=(0,), assigned=True)],
        ids(0, 8),
        envs={contract.ENV_GPU_MEM_IDX: "0"},
    ),
    Case(
        "volume-mounts, CDI and device nodes: every form the runtime may read, from the node's dev root",
        [placed("p", 4, gpus=(1,))],
        ids(1, 4),
        exposure=ExposurePolicy(
            strategies=frozenset({Strategy.VOLUME_MOUNTS, Strategy.CDI_CRI}), device_nodes=True, dev_root="/drv"
        ),
        present=("/dev/nvidia1", "/dev/nvidiactl"),
        envs={"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"},
        mounts=[(f"/var/run/nvidia-container-devices/{UUID[1]}", "/dev/null", True)],
        devices_given=["/dev/nvidia1", "/dev/nvidiactl"],
        cdi=[f"{CDI_KIND}={UUID[1]}"],
    ),
    Case(
        "an MPS pod gets its GPU's daemon, a thread share from its memory share, and a MiB ceiling on ordinal 0",
        [placed("m", 6, gpus=(1,), mps=True, inv=MPS_INV)],
        ids(1, 6),
        inventory=MPS_INV,
        mps=MPS_DIRS,
        envs={
            "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "38",  # 6/16, rounded up
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=6144M",
        },
        mounts=[
            ("/tmp/nvidia-mps", f"/run/mps/{UUID[1]}/pipe", False),
            ("/dev/shm", f"/run/mps/{UUID[1]}/shm", False),
        ],
    ),
    Case(
        "an MPS pod's thread share is the pod's own when it sets one",
        [edited(placed("m", 6, gpus=(1,), mps=True, inv=MPS_INV), **{contract.POD_MPS_THREAD_PERCENTAGE: "60"})],
        ids(1, 6),
        inventory=MPS_INV,
        mps=MPS_DIRS,
        envs={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"},
    ),
    Case(
        "an MPS pod's thread share is its compute limit when it gives one (the cap MPS enforces)",
        [edited(placed("m", 6, gpus=(1,), mps=True, inv=MPS_INV), **{contract.POD_COMPUTE_LIMIT: "40"})],
        ids(1, 6),
        inventory=MPS_INV,
        mps=MPS_DIRS,
        envs={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"},
    ),
    Case(
        "an MPS pod's compute limit raised after its bind: the recorded limit is its thread share",
        [edited(bound_with_limit("m", 6, gpu=1, limit="40"), **{contract.POD_COMPUTE_LIMIT: "90"})],
        ids(1, 6),
        inventory=MPS_INV,
        mps=MPS_DIRS,
        envs={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"},
    ),
    Case(
        "compute shares past 100 % on the GPU (bound so by a scheduler that did not count them): refused with the sum",
        [asking_compute("a", 2, 80, assigned=True), asking_compute("b", 2, 30)],
        ids(0, 2),
        refused=r"pod default/b would bring the compute requests on GPU 0 to 110 percent",
        event_on="b",
    ),
    Case(
        "a neighbour raised its compute request after its bind (50 -> 100): its bind record counts, granted",
        [
            edited(asking_compute("a", 2, 50, assigned=True), **{contract.POD_COMPUTE_REQUEST: "100"}),
            asking_compute("b", 2, 50),
        ],
        ids(0, 2),
    ),
    Case(
        "compute annotations added to pods whose bind recorded no share: they hold none, granted",
        [
            edited(placed("a", 2, gpus=(0,), assigned=True), **{contract.POD_COMPUTE_REQUEST: "80"}),
            edited(placed("b", 2, gpus=(0,)), **{contract.POD_COMPUTE_REQUEST: "30"}),
        ],
        ids(0, 2),
    ),
    # --- refused: the handshake cannot name one container (docs/design.md §7's table) ----------------------
    Case(
        "equal waiting pods on different GPUs: refused, naming both, not guessed",
        [placed("a", 2, gpus=(0,)), placed("b", 2, gpus=(1,))],
        ids(0, 2),
        refused=r"cannot tell which of pods default/a, default/b",
    ),
    Case(
        "a pod without a GPU choice bypassed the extender",
        [pod("rogue", 3, node="n1")],
        ids(0, 3),
        refused=r"pod default/rogue cannot get 3 GiB of GPU memory: .*not scheduled through gpushared-extender",
        event_on="rogue",
    ),
    Case(
        "malformed annotations: the parse error",
        [pod("bad", 3, node="n1", annotations={contract.POD_ALLOCATION: "{"})],
        ids(0, 3),
        refused=r"pod default/bad cannot get 3 GiB .*gpushared\.io/allocation: not valid JSON",
        event_on="bad",
    ),
    Case(
        "the kubelet's count differs from the annotated amount: both amounts",
        [placed("w", 4, gpus=(0,))],
        ids(0, 3),
        refused=r"kubelet asks for 3 GiB but container 'c0' was assigned 4 GiB on GPU 0",
        event_on="w",
    ),
    Case(
        "nobody waits for the amount",
        [],
        ids(0, 3),
        refused=r"no pod on node n1 is waiting for 3 GiB",
    ),
    # --- refused: the node cannot give the named container its GPU -----------------------------------------
    Case(
        "the GPU it was placed on is gone",
        [placed("p", 4, gpus=(2,))],
        ids(2, 4),
        inventory=inventory(16, 16),
        refused=r"placed on GPU 2, which node n1 does not have",
        event_on="p",
    ),
    Case(
        "the GPU at its index has another UUID now: the GPUs changed since it was scheduled",
        [placed("p", 4, gpus=(1,))],
        ids(1, 4),
        inventory=GpuInventory(
            unit=MemoryUnit.GIB, gpus=(INV.gpus[0], dataclasses.replace(INV.gpus[1], uuid="GPU-new"))
        ),
        refused=rf"placed on GPU 1 with UUID {UUID[1]}, but GPU 1 of node n1 is now GPU-new.*delete the pod",
        event_on="p",
    ),
    Case(
        "it does not fit beside what the GPU holds (another scheduler, or an extender bug)",
        [placed("p", 4, gpus=(2,)), placed("big", 6, gpus=(2,), assigned=True)],
        ids(2, 4),
        refused=r"would bring GPU 2 to 10 GiB of 8 GiB: it does not fit",
        event_on="p",
    ),
    Case(
        "the kubelet's devices are on another GPU (it did not take the preferred allocation)",
        [placed("p", 4, gpus=(1,))],
        ids(0, 4),
        refused=r"container 'c0' was placed on GPU 1, but the kubelet gave it devices \['0-0', '0-1', '0-2', '0-3'\]",
        event_on="p",
    ),
    Case(
        "a container on several GPUs given an uneven split of devices",
        [placed("train", 16, gpus=(1, 0))],
        ids(1, 10) + ids(0, 6),
        refused=r"was placed on GPUs 1, 0, but the kubelet gave it devices",
        event_on="train",
    ),
    Case(
        "device nodes asked for, but the GPU's file is not under the dev root: refused, naming the path",
        [placed("p", 4, gpus=(1,))],
        ids(1, 4),
        exposure=ExposurePolicy(dev_root="/run/nvidia/driver"),
        present=("/dev/nvidia0", "/dev/nvidiactl"),
        refused=rf"pod default/p: GPU {UUID[1]}'s device file /run/nvidia/driver/dev/nvidia1 does not exist",
        event_on="p",
    ),
    Case(
        "device nodes asked for, but NVML gave the GPU no minor number",
        [placed("p", 4, gpus=(1,))],
        ids(1, 4),
        minors={UUID[1]: None},
        refused=rf"pod default/p: GPU {UUID[1]} has no device minor number in NVML",
        event_on="p",
    ),
    Case(
        "an MPS pod on a node that runs no MPS daemons",
        [placed("m", 4, gpus=(1,), mps=True)],
        ids(1, 4),
        mps=None,
        refused=r"asks for MPS \(gpushared\.io/mps\), but node n1 runs no MPS daemons",
        event_on="m",
    ),
    Case(
        "an MPS pod whose containers were placed on two GPUs",
        [
            edited(
                placed("m", 2, 2, gpus=(0,), mps=True, inv=MPS_INV),
                **{
                    contract.POD_ALLOCATION: contract.format_allocation(
                        contract.Allocation(
                            unit=MemoryUnit.GIB,
                            containers=(
                                contract.ContainerShares("c0", (contract.GpuShare(0, UUID[0], 2),)),
                                contract.ContainerShares("c1", (contract.GpuShare(1, UUID[1], 2),)),
                            ),
                        )
                    )
                },
            )
        ],
        ids(0, 2),
        inventory=MPS_INV,
        mps=MPS_DIRS,
        refused=r"asks for MPS on GPUs \[0, 1\]: an MPS client reaches one GPU's daemon only",
        event_on="m",
    ),
    Case(
        "an MPS server's clients are all taken",
        [placed("m", 1, mps=True, inv=BIG)]
        + [placed(f"c{i}", 1, mps=True, assigned=True, inv=BIG) for i in range(MAX_MPS_CLIENTS)],
        ids(0, 1),
        inventory=BIG,
        mps=MPS_DIRS,
        refused=rf"would be MPS client {MAX_MPS_CLIENTS + 1} of GPU 0; an MPS server takes {MAX_MPS_CLIENTS}",
        event_on="m",
    ),
    Case(
        "an MPS pod whose GPU's control daemon does not answer",
        [placed("m", 4, gpus=(1,), mps=True, inv=MPS_INV)],
        ids(1, 4),
        inventory=MPS_INV,
        mps={UUID[0]: MPS_DIRS[UUID[0]]},
        refused=r"the MPS control daemon of GPU 1 is not running",
        event_on="m",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_allocate(case: Case) -> None:
    outcome = answer(case)
    if case.refused is not None:
        assert isinstance(outcome, Refusal), f"granted: {outcome}"
        assert re.search(case.refused, outcome.message), outcome.message
        named = (outcome.pod or {}).get("metadata", {}).get("name")
        assert named == case.event_on
        return
    assert isinstance(outcome, ContainerAllocation), f"refused: {outcome}"
    assert {k: outcome.envs.get(k) for k in case.envs} == case.envs
    if case.mounts is not None:
        assert [(m.container_path, m.host_path, m.read_only) for m in outcome.mounts] == case.mounts
    if case.devices_given is not None:
        assert [d.container_path for d in outcome.devices] == case.devices_given
        assert all(d.host_path.startswith(case.exposure.dev_root.rstrip("/") + "/dev/") for d in outcome.devices)
    if case.cdi is not None:
        assert list(outcome.cdi_devices) == case.cdi


def test_every_mps_ceiling_stays_within_the_gpu() -> None:
    """A GiB request on a GPU a few MiB short of whole GiB never pins more than the GPU has."""
    short = GpuInventory(
        unit=MemoryUnit.GIB,
        gpus=(dataclasses.replace(MPS_INV.gpus[0], memory=16, memory_mib=15360),),
    )
    case = Case("short", [placed("m", 16, gpus=(0,), mps=True, inv=short)], ids(0, 16), inventory=short, mps=MPS_DIRS)
    outcome = answer(case)
    assert isinstance(outcome, ContainerAllocation)
    assert outcome.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=15360M"
    assert outcome.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"


@pytest.mark.parametrize(
    ("gpus", "available", "must", "expected"),
    [
        ((1,), ids(0, 4) + ids(1, 4), [], ids(1, 2)),
        ((1,), ["1-10", "1-9", "1-2"], ["1-9"], ["1-9", "1-2"]),  # must-include first, then in number order
        ((1, 0), ids(0, 4) + ids(1, 4), [], ids(1, 1) + ids(0, 1)),  # a share of each of its GPUs
        ((2,), ids(2, 1), [], []),  # too few left on its GPU: no preference
    ],
)
def test_the_preferred_devices_are_the_slots_share_of_each_gpu(
    gpus: tuple[int, ...], available: list[str], must: list[str], expected: list[str]
) -> None:
    body = placed("p", 2, gpus=gpus)
    found = candidate(body, listed={"c0": []}, served=set(), unit=MemoryUnit.GIB, resources=DEFAULT_RESOURCES)
    assert found is not None and found.next is not None
    assert preferred_devices(found.next, available, must) == expected
