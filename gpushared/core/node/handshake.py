"""Which pod's container an Allocate call is for, though the kubelet does not say.

Kubelet calls GetPreferredAllocation and Allocate once per container with device IDs and a count, never a
pod. Aliyun's plugin guessed by request size and oldest assume time, so two equal pods bound at once could
swap GPUs. We use what the kubelet does show: it adds a pod to its pod manager just before admitting it,
admits pods one at a time, and records a container's devices only after Allocate has answered. So during
an admission, the kubelet's PodResources ``List`` holds exactly one of our GPU pods that still lacks
devices: the one being admitted. Its next GPU container, in kubelet's order (init containers, then app
containers, each in spec order), is the one asking. See docs/design.md, "The Allocate handshake".

This module is the decision, over data the daemon's manager gathers; it does no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpushared import contract
from gpushared.contract import ContractError, MemoryUnit, ResourceNames
from gpushared.core.shared.bodies import PodBody, annotations_of, qualified_name
from gpushared.core.shared.ledger import holds_gpu_memory
from gpushared.core.shared.requests import PodRequest, pod_request


@dataclass(frozen=True)
class Slot:
    """One GPU container of a pod and where the extender put it: one GPU, or with gpu-count several, each
    with an even share of ``amount``."""

    container: str
    init: bool
    amount: int  # units on all its GPUs: what the kubelet asks for
    #: (index, UUID) of each GPU; the UUID is None for pods placed by Aliyun's extender, which records the index
    gpus: tuple[tuple[int, str | None], ...]

    @property
    def indices(self) -> list[int]:
        return [index for index, _ in self.gpus]

    @property
    def share(self) -> int:
        """Units on each of its GPUs."""
        return self.amount // len(self.gpus)

    @property
    def where(self) -> str:
        """Its GPUs, in words: "GPU 1", "GPUs 0, 1"."""
        listed = ", ".join(str(index) for index in self.indices)
        return f"GPUs {listed}" if len(self.gpus) > 1 else f"GPU {listed}"


@dataclass
class Candidate:
    """A pod on this node that has GPU containers still waiting for devices."""

    pod: PodBody
    slots: list[Slot] | None  # None: nothing records a GPU choice for it
    next: Slot | None
    problem: str | None = None
    #: what the pod asks for, parsed once here and carried to the Allocate decision; None when unparseable
    request: PodRequest | None = None

    @property
    def key(self) -> str:
        return qualified_name(self.pod)

    @property
    def assume_time(self) -> int:
        text = annotations_of(self.pod).get(contract.ALIYUN_GPU_MEM_ASSUME_TIME, "")
        try:
            return contract.parse_int(contract.ALIYUN_GPU_MEM_ASSUME_TIME, text)
        except ContractError:
            return 0  # only orders pods that match alike; an unreadable time sorts first


class Unidentified(Exception):
    """No single container can be named; ``pod`` is the pod the message concerns, when there is one."""

    def __init__(self, message: str, *, pod: PodBody | None = None, retry: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.pod = pod
        self.retry = retry


def slots_of(pod: PodBody, *, unit: MemoryUnit, request: PodRequest) -> list[Slot] | None:
    """The pod's GPU containers in kubelet's order, or None when no GPU choice is recorded."""
    annotations = annotations_of(pod)
    if contract.POD_ALLOCATION in annotations:
        allocation = contract.parse_allocation(annotations[contract.POD_ALLOCATION])
        slots = []
        for container in sorted(allocation.containers, key=lambda c: not c.init):  # stable: spec order kept
            amounts = {share.amount for share in container.gpus}
            if len(amounts) != 1 or len({share.index for share in container.gpus}) != len(container.gpus):
                raise ContractError(
                    key=contract.POD_ALLOCATION,
                    value=container.name,
                    reason="a container on several GPUs must take the same share of each, on GPUs that differ",
                )
            amount = allocation.unit.convert(sum(share.amount for share in container.gpus), to=unit)
            gpus = tuple((share.index, share.uuid) for share in container.gpus)
            slots.append(Slot(container.name, container.init, amount, gpus))
        return slots
    if contract.ALIYUN_GPU_MEM_IDX in annotations:
        index = contract.parse_int(contract.ALIYUN_GPU_MEM_IDX, annotations[contract.ALIYUN_GPU_MEM_IDX])
        ordered = [c for c in request.containers if c.init] + [c for c in request.containers if not c.init]
        return [Slot(c.name, c.init, c.amount, ((index, None),)) for c in ordered]
    return None


def candidate(
    pod: PodBody,
    *,
    listed: Mapping[str, Sequence[str]] | None,
    served: set[str],
    unit: MemoryUnit,
    resources: ResourceNames,
) -> Candidate | None:
    """``pod`` as a candidate for the call, or None when it cannot be the pod being admitted.

    ``listed`` is the pod's containers with the devices kubelet gave them (PodResources: its app containers,
    and on kubelet >= 1.29 its restartable init containers, sidecars, too); ``served`` the containers this
    daemon answered Allocate for. Plain init containers are never listed: only ``served`` knows them, and
    once an app container has devices they are all done.
    """
    if not holds_gpu_memory(pod):
        return None
    if annotations_of(pod).get(contract.ALIYUN_GPU_MEM_ASSIGNED) == "true":
        return None
    try:
        request = pod_request(pod, resources=resources)
    except ContractError as exc:
        return Candidate(pod=pod, slots=None, next=None, problem=str(exc))
    if request.total == 0:
        return None
    try:
        slots = slots_of(pod, unit=unit, request=request)
    except ContractError as exc:
        return Candidate(pod=pod, slots=None, next=None, problem=str(exc), request=request)
    if slots is None:
        gpu_apps = [c.name for c in request.containers if not c.init]
        if listed is not None and gpu_apps and all(listed.get(name) for name in gpu_apps):
            return None  # already running: it was admitted some other way
        return Candidate(pod=pod, slots=None, next=None, request=request)
    apps_started = any(listed.get(s.container) for s in slots if not s.init) if listed is not None else False

    def done(slot: Slot) -> bool:
        if slot.container in served:
            return True
        if listed is not None and listed.get(slot.container):
            return True  # the kubelet lists its devices: an app container, or a sidecar on kubelet >= 1.29
        if slot.init:
            return apps_started
        return bool(listed.get(slot.container)) if listed is not None else False

    waiting = [s for s in slots if not done(s)]
    if not waiting:
        return None
    return Candidate(pod=pod, slots=slots, next=waiting[0], request=request)


@dataclass
class Decision:
    chosen: Candidate
    ambiguous_but_equivalent: list[str] = field(default_factory=list)


def identify(size: int, candidates: Sequence[Candidate], *, unit: MemoryUnit, node: str) -> Decision:
    """The candidate whose next container asks for ``size`` units; raises :class:`Unidentified`."""
    matching = [c for c in candidates if c.next is not None and c.next.amount == size]
    if len(matching) == 1:
        return Decision(chosen=matching[0])
    if len(matching) > 1:
        places = {c.next.gpus for c in matching if c.next is not None}
        if len(places) == 1:
            # Every candidate goes to the same GPU with the same amount: whichever it is, the GPU is right.
            ordered = sorted(matching, key=lambda c: (c.assume_time, c.key))
            return Decision(chosen=ordered[0], ambiguous_but_equivalent=[c.key for c in ordered[1:]])
        names = ", ".join(sorted(c.key for c in matching))
        raise Unidentified(
            f"cannot tell which of pods {names} (equal {size} {unit.value} requests on different GPUs) the kubelet "
            "is admitting: more than one is waiting in the kubelet's pod manager",
            retry=True,
        )
    unplaced = [c for c in candidates if c.slots is None]
    if len(unplaced) == 1 or (unplaced and len(candidates) == len(unplaced)):
        pod = unplaced[0]
        why = pod.problem or (
            "it has no GPU assignment: it was not scheduled through gpushared-extender "
            f"(no {contract.POD_ALLOCATION} or {contract.ALIYUN_GPU_MEM_IDX} annotation); check that kube-scheduler "
            "is configured with the extender for this resource"
        )
        raise Unidentified(f"pod {pod.key} cannot get {size} {unit.value} of GPU memory: {why}", pod=pod.pod)
    waiting = [c for c in candidates if c.next is not None]
    if len(waiting) == 1:
        slot = waiting[0].next
        assert slot is not None
        raise Unidentified(
            f"pod {waiting[0].key}: kubelet asks for {size} {unit.value} but container {slot.container!r} was "
            f"assigned {slot.amount} {unit.value} on {slot.where}; the pod's annotations do not match its spec",
            pod=waiting[0].pod,
        )
    raise Unidentified(
        f"no pod on node {node} is waiting for {size} {unit.value} of GPU memory "
        f"({len(waiting)} pods are waiting for other amounts)",
        retry=True,
    )
