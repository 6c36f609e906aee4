"""What a pod asks for: its GPU memory per container, and what it holds on a GPU at its peak.

Kubernetes defines a pod's effective request for a resource as the larger of what its init phase needs
and what runs together afterwards (KEP-753 adds restartable "sidecar" init containers, which keep running
beside everything started after them). Kubelet's device manager follows the same rule: devices given to an
init container are reused by later containers. Aliyun sums app containers only and ignores init containers,
which under-counts a pod whose init container is the larger one.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from gpushared import contract
from gpushared.contract import ContractError, ResourceNames
from gpushared.core.shared.bodies import Container, PodBody, annotations_of
from gpushared.core.shared.quantity import parse_whole_quantity


@dataclass(frozen=True)
class ContainerRequest:
    name: str
    amount: int
    init: bool = False
    sidecar: bool = False
    #: GPUs the amount is spread over, evenly (gpu-count; 1 when not asked)
    gpus: int = 1


def peak(containers: Iterable[ContainerRequest]) -> int:
    """Most units held at any one time by ``containers``, given in pod-spec order, init containers first."""
    sidecars = 0
    init_peak = 0
    apps = 0
    for container in containers:
        if container.sidecar:
            sidecars += container.amount
            init_peak = max(init_peak, sidecars)
        elif container.init:
            init_peak = max(init_peak, sidecars + container.amount)
        else:
            apps += container.amount
    return max(init_peak, sidecars + apps)


@dataclass(frozen=True)
class PodRequest:
    """The GPU memory of one pod: the containers that ask for any, and how it wants to share a GPU."""

    containers: tuple[ContainerRequest, ...]
    mps: bool = False
    thread_percentage: int | None = None
    #: its compute share of each of its GPUs (annotations); None: compute not scheduled, as before
    compute: contract.ComputeShare | None = None

    @property
    def compute_request(self) -> int:
        """Percent of each of its GPUs' compute the pod is guaranteed, and so holds in the ledger (0: none)."""
        return self.compute.request if self.compute is not None else 0

    @functools.cached_property
    def total(self) -> int:
        """Units held at the pod's peak (``peak``): asked for on every candidate node, worked out once."""
        return peak(self.containers)

    @functools.cached_property
    def gpus(self) -> int:
        """GPUs the pod takes: more than one only for a pod whose one GPU container asks for gpu-count."""
        return max((c.gpus for c in self.containers), default=1)

    @property
    def per_gpu(self) -> int:
        """Units the pod holds on each of its GPUs."""
        return self.total // self.gpus

    @property
    def app_sum(self) -> int:
        """The sum over app containers: what Aliyun writes as ``ALIYUN_COM_GPU_MEM_POD``. gpushared writes
        and hands containers :attr:`total`, the peak, for that key (docs/design.md §3)."""
        return sum(c.amount for c in self.containers if not c.init)


def container_amount(container: Container, *, resource: str, where: str) -> int:
    """A container's units of ``resource``: its limit, which for extended resources is also its request.

    The API server defaults a missing request to the limit and rejects a request that differs from it; a
    request without a limit is refused there too. We read both so that a body which skipped validation
    (a fake, an old object) still gets a precise error instead of a guess.
    """
    resources = container.get("resources") or {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    key = f"{where}.resources"
    limit = parse_whole_quantity(f"{key}.limits[{resource}]", limits[resource]) if resource in limits else None
    request = parse_whole_quantity(f"{key}.requests[{resource}]", requests[resource]) if resource in requests else None
    if limit is not None and request is not None and limit != request:
        raise ContractError(
            key=f"{key}[{resource}]",
            value={"requests": requests[resource], "limits": limits[resource]},
            reason="the request of an extended resource must equal its limit",
        )
    if limit is not None:
        return limit
    return request or 0


def pod_request(pod: PodBody, *, resources: ResourceNames = contract.DEFAULT_RESOURCES) -> PodRequest:
    """The pod's GPU memory request; raises :class:`ContractError` for malformed quantities or annotations, or
    for a pod on several GPUs that we cannot serve exactly."""
    found = _containers(pod, resources)
    annotations = annotations_of(pod)
    mps = (
        contract.parse_bool(contract.POD_MPS, annotations[contract.POD_MPS])
        if contract.POD_MPS in annotations
        else False
    )
    percentage = (
        contract.parse_thread_percentage(annotations[contract.POD_MPS_THREAD_PERCENTAGE])
        if contract.POD_MPS_THREAD_PERCENTAGE in annotations
        else None
    )
    compute = contract.parse_compute(annotations)
    if compute is not None and percentage is not None and compute.limit != percentage:
        raise ContractError(
            key=contract.POD_MPS_THREAD_PERCENTAGE,
            value=annotations[contract.POD_MPS_THREAD_PERCENTAGE],
            reason=f"differs from {contract.POD_COMPUTE_LIMIT} ({compute.limit}), which is the MPS thread "
            "percentage of a pod that gives it: give one of the two",
        )
    if compute is not None and not found:
        raise ContractError(
            key=contract.POD_COMPUTE_REQUEST if compute.request else contract.POD_COMPUTE_LIMIT,
            value=compute,
            reason=f"a compute share is a share of the pod's GPUs, and it asks for none ({resources.gpu_mem})",
        )
    for request in found:
        if request.gpus > 1 and len(found) > 1:
            raise ContractError(
                key=f"{resources.gpu_count} of container {request.name}",
                value=request.gpus,
                reason="a container on several GPUs must be the pod's only container with GPU memory",
            )
        if request.gpus > 1 and mps:
            raise ContractError(
                key=contract.POD_MPS,
                value=annotations[contract.POD_MPS],
                reason=f"container {request.name} asks for {request.gpus} GPUs, and an MPS client reaches one "
                "MPS server only: an MPS pod gets exactly one GPU",
            )
    return PodRequest(containers=tuple(found), mps=mps, thread_percentage=percentage, compute=compute)


def spec_request(pod: PodBody, *, resources: ResourceNames = contract.DEFAULT_RESOURCES) -> PodRequest:
    """What the pod's spec alone asks for, without its annotations and the rules on combining containers:
    the amount a pod whose annotations cannot be read (or that asks for something we cannot serve) is
    still counted at, so that memory a running pod may use is never forgotten. Raises
    :class:`ContractError` only for a quantity that cannot be read (which the API server refuses)."""
    return PodRequest(containers=tuple(_containers(pod, resources, strict=False)))


def _containers(pod: PodBody, resources: ResourceNames, *, strict: bool = True) -> list[ContainerRequest]:
    """The pod's GPU containers, init containers first. Not ``strict``: a container whose gpu-count we
    refuse to serve is read as its gpu-mem on one GPU rather than refused."""
    spec = pod.get("spec") or {}
    found = []
    for containers, init in ((spec.get("initContainers") or [], True), (spec.get("containers") or [], False)):
        for position, container in enumerate(containers):
            try:
                request = _container_request(container, position, resources, init=init)
            except ContractError:
                if strict:
                    raise
                request = _container_request(container, position, resources, init=init, count=False)
            if request is not None:
                found.append(request)
    return found


def _container_request(
    container: Container, position: int, resources: ResourceNames, *, init: bool, count: bool = True
) -> ContainerRequest | None:
    """One container's GPU memory and the GPUs to spread it over; None when it asks for no GPU memory.

    ``gpu-count`` N > 1 gives the container N GPUs with gpu-mem / N on each: whole GPUs when that is a GPU's
    memory, shares of N GPUs otherwise. Without gpu-mem it would get no GPU at all (kubelet calls the device
    plugin for gpu-mem only), so that is refused rather than scheduled as a pod without GPU.
    """
    name = container.get("name", f"#init{position}" if init else f"#{position}")
    where = f"spec.{'initContainers' if init else 'containers'}[{position}]({name})"
    amount = container_amount(container, resource=resources.gpu_mem, where=where)
    gpus = container_amount(container, resource=resources.gpu_count, where=where) if count else 0
    if gpus and not amount:
        raise ContractError(
            key=f"{where}.resources.limits[{resources.gpu_count}]",
            value=gpus,
            reason=f"GPUs are given with GPU memory: ask for {resources.gpu_mem} too (the memory on all of them)",
        )
    if gpus > 1 and amount % gpus:
        raise ContractError(
            key=f"{where}.resources.limits[{resources.gpu_mem}]",
            value=amount,
            reason=f"is spread evenly over the container's {gpus} GPUs ({resources.gpu_count}), so it must be a "
            f"multiple of {gpus}",
        )
    if not amount:
        return None
    sidecar = init and container.get("restartPolicy") == "Always"
    return ContainerRequest(name=name, amount=amount, init=init, sidecar=sidecar, gpus=max(gpus, 1))
