"""The daemon's answer to one Allocate call, decided from what the node knows at that moment.

The handshake (``core.node.handshake``) names the container the kubelet asks for; ``decide`` checks that the
node can still give it the GPU its annotations name and says what the container gets: the Aliyun env, the
GPU in the form the node's runtime reads (``core.node.exposure``), and for an MPS pod its daemon's pipe, thread
share and memory ceiling. It is a pure function over gathered facts, so every refusal in docs/design.md §7
is one row of a table test (tests/unit/test_allocate.py), the way NVIDIA's plugin tests its Allocate.
The daemon's manager gathers the facts (the pod, the ledger, the daemons that answer, the device files
present) and acts on the outcome (answers the kubelet, writes Events, records what it served).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from gpushared import contract
from gpushared.contract import GpuInfo, GpuInventory
from gpushared.core.node.devices import gpu_of, natural
from gpushared.core.node.exposure import CannotExpose, DeviceFile, ExposedGpu, ExposurePolicy, exposure
from gpushared.core.node.handshake import Candidate, Slot
from gpushared.core.shared.bodies import PodBody, annotations_of, uid_of
from gpushared.core.shared.ledger import Ledger, recorded_compute
from gpushared.core.shared.verdicts import MAX_MPS_CLIENTS

#: Where an MPS client container finds its GPU's control daemon: the pipe directory is mounted here, at MPS's
#: own default, so a client whose env was cleared still reaches the daemon instead of running without limits.
MPS_CONTAINER_PIPE_DIRECTORY: Final = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerAllocation:
    """What one container gets; the device-plugin server turns it into the kubelet's response."""

    envs: dict[str, str]
    mounts: Sequence[Mount] = field(default_factory=tuple)
    annotations: dict[str, str] = field(default_factory=dict)
    #: device files the runtime creates in the container (core.node.exposure decides which)
    devices: Sequence[DeviceFile] = field(default_factory=tuple)
    #: fully qualified CDI device names; kubelets before 1.28 do not know the field and drop it.
    cdi_devices: Sequence[str] = field(default_factory=tuple)


@dataclass(frozen=True)
class Refusal:
    """Why the container gets nothing. ``pod``, when there is one, gets the message as a warning Event."""

    message: str
    pod: PodBody | None = None


@dataclass(frozen=True)
class MpsDaemon:
    """The host directories of one GPU's MPS control daemon that a client container mounts."""

    pipe: str
    shm: str


@dataclass(frozen=True)
class NodeFacts:
    """What the node has when the call comes, as the manager gathered it."""

    name: str
    inventory: GpuInventory
    #: this node's pods' holdings (the pod being admitted may be among them already)
    ledger: Ledger
    exposure: ExposurePolicy = field(default_factory=ExposurePolicy)
    #: GPU UUID -> the minor number of its /dev/nvidia<minor>
    minors: Mapping[str, int | None] = field(default_factory=dict)
    #: the device files (GPUs' and core.node.exposure.CONTROL_DEVICES) present on the node, as container paths
    #: (read only when deviceNodes is on)
    present_devices: Collection[str] = ()
    #: GPU UUID -> its MPS control daemon, for those that answer; None when the node runs no MPS daemons
    mps: Mapping[str, MpsDaemon] | None = None


def decide(chosen: Candidate, devices: Sequence[str], node: NodeFacts) -> ContainerAllocation | Refusal:
    """The allocation for ``chosen``'s next container, given the kubelet's ``devices``; or why not.

    Checked in order: each GPU the pod was placed on still exists with the UUID recorded at bind; each has
    room for the container's share with the pod counted once; the kubelet's devices are that share of each
    of those GPUs; the runtime can be handed the GPU; and for an MPS pod, the MPS checks (``_mps``).
    """
    slot, request, pod = chosen.next, chosen.request, chosen.pod
    assert slot is not None, "decide() takes a candidate the handshake named"
    assert request is not None, "a named candidate's request was parsed"
    unit = node.inventory.unit.value
    key = chosen.key
    gpus: list[GpuInfo] = []
    for index, uuid in slot.gpus:
        gpu = node.inventory.by_index(index)
        if gpu is None:
            return Refusal(f"pod {key} was placed on GPU {index}, which node {node.name} does not have", pod)
        if uuid is not None and uuid != gpu.uuid:
            return Refusal(
                f"pod {key} was placed on GPU {index} with UUID {uuid}, but GPU {index} of node "
                f"{node.name} is now {gpu.uuid}: the GPUs changed since it was scheduled; delete the pod",
                pod,
            )
        gpus.append(gpu)
    held = node.ledger.holding(uid_of(pod)) is not None
    for gpu in gpus:
        used = node.ledger.used(gpu.index) + (0 if held else slot.share)
        if used > gpu.memory:
            return Refusal(
                f"pod {key} would bring GPU {gpu.index} to {used} {unit} of {gpu.memory} {unit}: "
                "it does not fit; was it scheduled by another scheduler?",
                pod,
            )
        compute = node.ledger.compute_used(gpu.index) + (0 if held else request.compute_request)
        if compute > 100:
            return Refusal(
                f"pod {key} would bring the compute requests on GPU {gpu.index} to {compute} percent: "
                "it does not fit; was it scheduled by another scheduler?",
                pod,
            )
    # The kubelet counts devices per GPU: its books and ours must agree on every GPU.
    if Counter(gpu_of(d) for d in devices) != dict.fromkeys(slot.indices, slot.share):
        return Refusal(
            f"pod {key} container {slot.container!r} was placed on {slot.where}, but the kubelet gave "
            f"it devices {sorted(devices)[:8]} (it did not take gpushared's preferred allocation)",
            pod,
        )
    try:
        given = exposure(
            node.exposure,
            [ExposedGpu(gpu.uuid, node.minors.get(gpu.uuid)) for gpu in gpus],
            present=node.present_devices,
        )
    except CannotExpose as exc:
        return Refusal(f"pod {key}: {exc}", pod)
    envs = {
        **given.envs,
        contract.ENV_GPU_MEM_IDX: ",".join(str(gpu.index) for gpu in gpus),
        contract.ENV_GPU_MEM_POD: str(request.total),
        contract.ENV_GPU_MEM_CONTAINER: str(slot.amount),
        contract.ENV_GPU_MEM_DEV: str(gpus[0].memory),
    }
    mounts = [Mount(container_path=inside, host_path=outside, read_only=True) for inside, outside in given.mounts]
    if request.mps:
        mps = _mps(chosen, slot, gpus[0], node, held=held)
        if isinstance(mps, Refusal):
            return mps
        mps_envs, mps_mounts = mps
        envs.update(mps_envs)
        mounts += mps_mounts
    return ContainerAllocation(
        envs=envs,
        mounts=mounts,
        devices=given.devices,
        cdi_devices=given.cdi_devices,
        annotations=dict(given.annotations),
    )


def _mps(
    chosen: Candidate, slot: Slot, gpu: GpuInfo, node: NodeFacts, *, held: bool
) -> tuple[dict[str, str], list[Mount]] | Refusal:
    """An MPS pod's container: checked (a node with MPS, one GPU, room for a client, a daemon that
    answers), then the env and mounts that make it that daemon's client."""
    key, pod = chosen.key, chosen.pod
    if node.mps is None:
        return Refusal(
            f"pod {key} asks for MPS ({contract.POD_MPS}), but node {node.name} runs no MPS daemons: "
            "set mps.enabled in the gpushared configuration, or remove the annotation",
            pod,
        )
    indices = sorted({index for s in chosen.slots or [] for index in s.indices})
    if len(indices) > 1:
        return Refusal(
            f"pod {key} asks for MPS on GPUs {indices}: an MPS client reaches one GPU's daemon only; "
            "put its containers on one GPU or drop the annotation",
            pod,
        )
    clients = node.ledger.mps_clients(gpu.index) + (0 if held else 1)  # this pod counted once
    if clients > MAX_MPS_CLIENTS:
        return Refusal(
            f"pod {key} would be MPS client {clients} of GPU {gpu.index}; an MPS server takes {MAX_MPS_CLIENTS}",
            pod,
        )
    daemon = node.mps.get(gpu.uuid)
    if daemon is None:
        return Refusal(
            f"pod {key}: the MPS control daemon of GPU {gpu.index} is not running; see gpushared status", pod
        )
    assert chosen.request is not None
    request = chosen.request
    # The pod's compute limit is its thread percentage (pod_request refuses a different override), never
    # above the limit its bind recorded: its owner may raise the annotation between bind and Allocate.
    override = request.thread_percentage or (request.compute.limit if request.compute is not None else None)
    bound = recorded_compute(annotations_of(pod))
    if bound is not None and override is not None:
        override = min(override, bound.limit)
    percentage = thread_percentage(amount=slot.amount, gpu_memory=gpu.memory, override=override)
    amount_mib = node.inventory.unit.to_mib(slot.amount)
    return mps_client(daemon, amount_mib=amount_mib, gpu_memory_mib=gpu.memory_mib, percentage=percentage)


def mps_client(
    daemon: MpsDaemon, *, amount_mib: int, gpu_memory_mib: int, percentage: int
) -> tuple[dict[str, str], list[Mount]]:
    """The env and mounts that make a container a client of ``daemon`` with these limits."""
    envs = {
        "CUDA_MPS_PIPE_DIRECTORY": MPS_CONTAINER_PIPE_DIRECTORY,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percentage),
        # Ordinal 0: the container sees exactly one GPU.
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={min(amount_mib, gpu_memory_mib)}M",
    }
    mounts = [
        Mount(container_path=MPS_CONTAINER_PIPE_DIRECTORY, host_path=daemon.pipe, read_only=False),
        Mount(container_path="/dev/shm", host_path=daemon.shm, read_only=False),
    ]
    return envs, mounts


def thread_percentage(*, amount: int, gpu_memory: int, override: int | None) -> int:
    """The container's share of the GPU's threads: its share of the memory, rounded up, unless the pod says."""
    if override is not None:
        return override
    if gpu_memory <= 0:
        return 100
    return max(1, min(100, math.ceil(100 * amount / gpu_memory)))


def preferred_devices(slot: Slot, available: Sequence[str], must_include: Sequence[str]) -> list[str]:
    """The devices GetPreferredAllocation offers ``slot``: its share of each of its GPUs, the kubelet's
    must-include devices first; empty (no preference) when a GPU has too few available."""
    ordered = sorted(available, key=natural)
    chosen: list[str] = []
    for index in slot.indices:
        on_gpu = [d for d in must_include if gpu_of(d) == index]
        on_gpu += [d for d in ordered if gpu_of(d) == index and d not in on_gpu]
        if len(on_gpu) < slot.share:
            return []
        chosen += on_gpu[: slot.share]
    return chosen
