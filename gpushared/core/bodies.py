"""The parts of Kubernetes objects the core reads, as TypedDicts over plain JSON.

The core never sees client-library model classes: adapters hand it the dicts the API server sent (or
``ApiClient.sanitize_for_serialization`` of a model), so the same code serves the extender's watch cache,
the daemon's pod lookups, the inspect tool and the trace replay.
"""

from __future__ import annotations

from typing import Any, TypedDict

from gpushared import contract


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


_ALIYUN_KEYS = frozenset(
    {
        contract.ALIYUN_GPU_MEM_IDX,
        contract.ALIYUN_GPU_MEM_DEV,
        contract.ALIYUN_GPU_MEM_POD,
        contract.ALIYUN_GPU_MEM_ASSIGNED,
        contract.ALIYUN_GPU_MEM_ASSUME_TIME,
        contract.ALIYUN_FRAMEWORK_ALLOCATION,
    }
)


def _ours(key: str) -> bool:
    return key in _ALIYUN_KEYS or key.startswith(contract.ANNOTATION_DOMAIN + "/")


def slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod with only what gpushared reads: its identity and resourceVersion, our and Aliyun's
    annotations, node, containers' names, resources and restart policy, phase and container states.

    A watch cache of 150k pods holds each one for as long as it runs; whole pod objects (env, volumes,
    managed fields, last-applied annotations) cost several KiB each, these a few hundred bytes."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    slim_meta = {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "deletionTimestamp") if k in meta}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if _ours(k)}
    if annotations:
        slim_meta["annotations"] = annotations
    slim_spec: dict[str, Any] = {}
    if spec.get("nodeName"):
        slim_spec["nodeName"] = spec["nodeName"]
    for part in ("initContainers", "containers"):
        if spec.get(part):
            slim_spec[part] = [{k: c[k] for k in ("name", "resources", "restartPolicy") if k in c} for c in spec[part]]
    slim: dict[str, Any] = {"metadata": slim_meta, "spec": slim_spec}
    slim_status = {k: status[k] for k in ("phase",) if k in status}
    for part in ("containerStatuses", "initContainerStatuses"):
        if status.get(part):
            slim_status[part] = [{k: c[k] for k in ("name", "state") if k in c} for c in status[part]]
    if slim_status:
        slim["status"] = slim_status
    return slim
