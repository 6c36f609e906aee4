"""CPU as kube-scheduler's NodeResourcesFit counts it: what a node offers pods and what a pod asks for, in
milli-CPU. The extender sees GPU memory through its own resources, but the fgd policy weighs CPU too: free
GPU memory on a node whose CPU is gone is stranded.
"""

from __future__ import annotations

from gpushared.contract import ContractError
from gpushared.core.shared.bodies import NodeBody, PodBody
from gpushared.core.shared.quantity import parse_milli_quantity
from gpushared.core.shared.requests import ContainerRequest, peak


def cpu_request(pod: PodBody) -> int:
    """The pod's milli-CPU as kube-scheduler's NodeResourcesFit counts it: the peak of its containers'
    requests (``peak``: the init phase against what runs together after it) plus the pod's overhead.

    A malformed quantity (the API server refuses those, so only a body that skipped validation has one)
    raises :class:`ContractError`.
    """
    spec = pod.get("spec") or {}
    found: list[ContainerRequest] = []
    parts = (("initContainers", spec.get("initContainers"), True), ("containers", spec.get("containers"), False))
    for part, containers, init in parts:
        for position, container in enumerate(containers or []):
            asked = ((container.get("resources") or {}).get("requests") or {}).get("cpu")
            if asked is not None:
                name = container.get("name", f"#{position}")
                amount = parse_milli_quantity(f"spec.{part}[{position}]({name}).resources.requests[cpu]", asked)
                sidecar = init and container.get("restartPolicy") == "Always"
                found.append(ContainerRequest(name=name, amount=amount, init=init, sidecar=sidecar))
    overhead = (spec.get("overhead") or {}).get("cpu")
    return peak(found) + (parse_milli_quantity("spec.overhead[cpu]", overhead) if overhead is not None else 0)


def memory_request(pod: PodBody) -> int:
    """The pod's memory request in bytes as NodeResourcesFit counts it (the peak of its containers', plus
    overhead); 0 for a quantity that cannot be read (the API server refuses those)."""
    spec = pod.get("spec") or {}
    found: list[ContainerRequest] = []
    try:
        parts = (("initContainers", spec.get("initContainers"), True), ("containers", spec.get("containers"), False))
        for part, containers, init in parts:
            for position, container in enumerate(containers or []):
                asked = ((container.get("resources") or {}).get("requests") or {}).get("memory")
                if asked is not None:
                    amount = parse_milli_quantity(f"spec.{part}[{position}].resources.requests[memory]", asked)
                    sidecar = init and container.get("restartPolicy") == "Always"
                    found.append(
                        ContainerRequest(name=str(position), amount=-(-amount // 1000), init=init, sidecar=sidecar)
                    )
        overhead = (spec.get("overhead") or {}).get("memory")
        extra = 0 if overhead is None else -(-parse_milli_quantity("spec.overhead[memory]", overhead) // 1000)
    except ContractError:
        return 0
    return peak(found) + extra


def allocatable_memory(node: NodeBody) -> int | None:
    """The bytes of memory pods may request on the node; None when the node does not say it readably."""
    value = ((node.get("status") or {}).get("allocatable") or {}).get("memory")
    if value is None:
        return None
    try:
        return -(-parse_milli_quantity("status.allocatable[memory]", value) // 1000)
    except ContractError:
        return None


def allocatable_cpu(node: NodeBody) -> int | None:
    """The milli-CPU pods may request on the node in all; None when the node does not say, or says it in a
    way that cannot be read (then the node's CPU is not weighed)."""
    value = ((node.get("status") or {}).get("allocatable") or {}).get("cpu")
    if value is None:
        return None
    try:
        return parse_milli_quantity("status.allocatable[cpu]", value)
    except ContractError:
        return None


def holds_cpu(pod: PodBody) -> bool:
    """Whether kube-scheduler counts the pod's CPU against its node: until it has finished."""
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def cpu_of(pod: PodBody) -> int:
    """The pod's milli-CPU request; 0 for one whose quantities cannot be read (the API server refuses
    those, so only a body that skipped validation has one; its GPU memory is what must not be lost)."""
    try:
        return cpu_request(pod)
    except ContractError:
        return 0
