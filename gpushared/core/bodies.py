"""The parts of Kubernetes objects the core reads, as TypedDicts over plain JSON.

The core never sees client-library model classes: adapters hand it the dicts the API server sent (or
``ApiClient.sanitize_for_serialization`` of a model), so the same code serves the extender's watch cache,
the daemon's pod lookups, the inspect tool and the trace replay.
"""

from __future__ import annotations

from typing import TypedDict


class ObjectMeta(TypedDict, total=False):
    name: str
    namespace: str
    uid: str
    resourceVersion: str
    annotations: dict[str, str]
    labels: dict[str, str]
    deletionTimestamp: str | None


class ResourceRequirements(TypedDict, total=False):
    limits: dict[str, str | int]
    requests: dict[str, str | int]


class Container(TypedDict, total=False):
    name: str
    resources: ResourceRequirements
    restartPolicy: str


class PodSpec(TypedDict, total=False):
    nodeName: str
    containers: list[Container]
    initContainers: list[Container]


class ContainerStateTerminated(TypedDict, total=False):
    exitCode: int


class ContainerState(TypedDict, total=False):
    terminated: ContainerStateTerminated | None
    running: dict[str, object] | None
    waiting: dict[str, object] | None


class ContainerStatus(TypedDict, total=False):
    name: str
    state: ContainerState


class PodStatus(TypedDict, total=False):
    phase: str
    containerStatuses: list[ContainerStatus]
    initContainerStatuses: list[ContainerStatus]


class PodBody(TypedDict, total=False):
    metadata: ObjectMeta
    spec: PodSpec
    status: PodStatus


class NodeAddress(TypedDict, total=False):
    type: str
    address: str


class NodeStatus(TypedDict, total=False):
    capacity: dict[str, str | int]
    allocatable: dict[str, str | int]
    addresses: list[NodeAddress]


class NodeBody(TypedDict, total=False):
    metadata: ObjectMeta
    status: NodeStatus
