"""The parts of Kubernetes objects the core reads, as TypedDicts over plain JSON.

The core never sees client-library model classes: adapters hand it the dicts the API server sent (or
``ApiClient.sanitize_for_serialization`` of a model), so the same code serves the extender's watch cache,
the daemon's pod lookups, the inspect tool and the trace replay.
"""

from __future__ import annotations

import sys
from typing import Any, TypedDict, cast

from gpushared import contract


class ObjectMeta(TypedDict, total=False):
    name: str
    generateName: str
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
    overhead: dict[str, str | int]
    schedulerName: str
    #: ``{name, resourceClaimName | resourceClaimTemplateName}``: the DRA claims the pod uses
    resourceClaims: list[dict[str, object]]
    #: ``{name}``: what holds the pod back from scheduling (set at creation, only ever removed)
    schedulingGates: list[dict[str, object]]
    #: resolved from its PriorityClass by the API server at creation (0 where it names none)
    priority: int
    #: ``Never``: the pod waits rather than have others evicted for it
    preemptionPolicy: str


class ContainerStateTerminated(TypedDict, total=False):
    exitCode: int


class ContainerState(TypedDict, total=False):
    terminated: ContainerStateTerminated | None
    running: dict[str, object] | None
    waiting: dict[str, object] | None


class ContainerStatus(TypedDict, total=False):
    name: str
    state: ContainerState
    #: ``<runtime>://<id>`` once the container was created
    containerID: str


class PodStatus(TypedDict, total=False):
    phase: str
    #: ``{name, resourceClaimName}``: the claim made from each template the pod names (DRA)
    resourceClaimStatuses: list[dict[str, object]]
    containerStatuses: list[ContainerStatus]
    initContainerStatuses: list[ContainerStatus]
    #: the node kube-scheduler evicted pods on for this one, and expects it to go to
    nominatedNodeName: str


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


#: A Kubernetes object as the core reads it.
#: Any other object a watch mirrors (DRA's ResourceClaims and ResourceSlices), read where it is used.
ObjectBody = dict[str, Any]
Body = PodBody | NodeBody | ObjectBody
#: (namespace, name): namespace "" for cluster-scoped objects
Key = tuple[str, str]

_NO_META: ObjectMeta = {}
_NO_ANNOTATIONS: dict[str, str] = {}


def meta_of(obj: Body) -> ObjectMeta:
    """The object's metadata; empty (shared, never to be changed) when it has none."""
    return obj.get("metadata") or _NO_META


def uid_of(obj: Body) -> str:
    return meta_of(obj).get("uid") or ""


def key_of(obj: Body) -> Key:
    meta = meta_of(obj)
    return meta.get("namespace") or "", meta.get("name") or ""


def qualified_name(obj: Body) -> str:
    """``namespace/name``, as messages and Events name a pod."""
    meta = meta_of(obj)
    return f"{meta.get('namespace')}/{meta.get('name')}"


def version_of(obj: Body) -> int:
    """The resourceVersion as a number; 0 when it has none (or one that is not a number)."""
    text = meta_of(obj).get("resourceVersion") or "0"
    return int(text) if text.isdigit() else 0


def annotations_of(obj: Body) -> dict[str, str]:
    """The object's annotations; empty (shared, never to be changed) when it has none."""
    return meta_of(obj).get("annotations") or _NO_ANNOTATIONS


def node_of(pod: PodBody) -> str:
    """The node a pod is bound to; "" while it is not."""
    return (pod.get("spec") or {}).get("nodeName") or ""


def scheduler_of(pod: PodBody) -> str:
    """The scheduler the pod waits for (the API server writes ``default-scheduler`` when none is named)."""
    return (pod.get("spec") or {}).get("schedulerName") or "default-scheduler"


def awaits_node(pod: PodBody) -> bool:
    """Whether the pod waits for a scheduler: not bound, not being deleted, not finished (a pod that failed
    before it was bound, e.g. evicted from the queue, never will be)."""
    if node_of(pod) or meta_of(pod).get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") in (None, "Pending")


#: Aliyun's annotations that say what a pod holds (and _DEV, which a bind may have to overwrite); the
#: other one (_ASSUME_TIME) only the node reads.
_ALIYUN_KEYS = frozenset(
    {
        contract.ALIYUN_GPU_MEM_IDX,
        contract.ALIYUN_GPU_MEM_POD,
        contract.ALIYUN_GPU_MEM_DEV,
        contract.ALIYUN_GPU_MEM_ASSIGNED,
        contract.ALIYUN_FRAMEWORK_ALLOCATION,
    }
)
#: Of those, the ones with a few values in all (a GPU index, an amount, a GPU size, true/false).
_SMALL_VALUES = frozenset(
    {
        contract.ALIYUN_GPU_MEM_IDX,
        contract.ALIYUN_GPU_MEM_POD,
        contract.ALIYUN_GPU_MEM_DEV,
        contract.ALIYUN_GPU_MEM_ASSIGNED,
    }
)
#: The extended resources a pod's GPU request is made of, whatever their domain.
_GPU_RESOURCES = ("/gpu-mem", "/gpu-count")
#: And the one other resource it weighs (fgd): the CPU request.
_CPU_REQUEST = ("requests", "cpu")
_MEMORY_REQUEST = ("requests", "memory")


def _ours(key: str) -> bool:
    return key in _ALIYUN_KEYS or key.startswith(contract.ANNOTATION_DOMAIN + "/")


def _slim_container(container: dict[str, Any]) -> dict[str, Any]:
    """Name, restart policy, GPU resources, CPU and memory requests only (the fgd policy weighs nodes' CPU;
    the claim allocator breaks ties with kube-scheduler's scores of CPU and memory). A
    container without them stays, as its name alone, so that positions in error messages
    (``spec.containers[2]``) stay those of the pod."""
    slim: dict[str, Any] = {"name": sys.intern(container.get("name", ""))}
    resources = container.get("resources") or {}
    kept = {
        kind: {
            sys.intern(k): v
            for k, v in amounts.items()
            if k.endswith(_GPU_RESOURCES) or (kind, k) in (_CPU_REQUEST, _MEMORY_REQUEST)
        }
        for kind, amounts in resources.items()
        if kind in ("limits", "requests") and amounts
    }
    kept = {kind: amounts for kind, amounts in kept.items() if amounts}
    if kept:
        slim["resources"] = kept
    if "restartPolicy" in container:
        slim["restartPolicy"] = sys.intern(container["restartPolicy"])
    return slim


#: Parts of slim pods seen, by content: pods of one workload ask alike, on a few thousand nodes, so their
#: container lists, specs and statuses repeat.
_SHARED: dict[tuple[Any, ...], Any] = {}
_SHARED_LIMIT = 1 << 17


def _shared(key: tuple[Any, ...], value: Any) -> Any:
    """The value already kept for ``key``, else ``value``, kept. Slim pods are read, never changed in place (a
    change is a new object from the watch), so equal parts can be one object. The table forgets all when it
    grows past its limit (a cluster of unlike pods): that costs sharing, never correctness."""
    known = _SHARED.get(key)
    if known is None:
        if len(_SHARED) >= _SHARED_LIMIT:
            _SHARED.clear()
        known = _SHARED[key] = value
    return known


def _shared_containers(containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    key = tuple(
        (
            c["name"],
            c.get("restartPolicy"),
            tuple((kind, tuple(sorted(amounts.items()))) for kind, amounts in sorted(c.get("resources", {}).items())),
        )
        for c in containers
    )
    return cast(list[dict[str, Any]], _shared(("containers", *key), containers))


def slim_pod(pod: PodBody) -> PodBody:
    """The pod with only what the extender reads: its identity and resourceVersion, the annotations that say
    what it holds, its labels (for PodDisruptionBudgets), its node, its containers' names, GPU resources and
    CPU requests, its phase, and, once it is being deleted, which of its containers have terminated (before
    that, no container state changes what it holds).

    A watch cache holds each pod for as long as it runs, and whole pod objects (env, volumes, managed
    fields, last-applied annotations) are mostly what the extender never reads. Keys and the values many
    pods share (namespace, node, container names) are interned, so the cache keeps one copy of each (what
    a slim pod costs: docs/benchmarks.md, "Figures behind the code")."""
    meta: Any = pod.get("metadata") or {}
    spec: Any = pod.get("spec") or {}
    status: Any = pod.get("status") or {}
    kept = ("name", "uid", "resourceVersion", "deletionTimestamp")
    slim_meta: dict[str, Any] = {k: meta[k] for k in kept if k in meta}
    if "namespace" in meta:
        slim_meta["namespace"] = sys.intern(meta["namespace"])
    annotations = {
        sys.intern(k): sys.intern(v) if k in _SMALL_VALUES and isinstance(v, str) else v
        for k, v in (meta.get("annotations") or {}).items()
        if _ours(k)
    }
    if annotations:
        slim_meta["annotations"] = annotations
    labels = meta.get("labels")
    if labels and isinstance(labels, dict):  # which PodDisruptionBudgets select it (preemption); shared when alike
        slim_meta["labels"] = _shared(("labels", *sorted(labels.items())), labels)
    slim_spec: dict[str, Any] = {}
    if spec.get("nodeName"):
        slim_spec["nodeName"] = sys.intern(spec["nodeName"])
    if spec.get("schedulerName") not in (None, "", "default-scheduler"):  # whose binds it waits for
        slim_spec["schedulerName"] = sys.intern(str(spec["schedulerName"]))
    if isinstance(spec.get("priority"), int) and spec["priority"]:  # who may be evicted for whom
        slim_spec["priority"] = spec["priority"]
    if spec.get("preemptionPolicy") == "Never":  # a pod that waits rather than have others evicted
        slim_spec["preemptionPolicy"] = "Never"
    for part in ("initContainers", "containers"):
        if spec.get(part):
            slim_spec[part] = _shared_containers([_slim_container(c) for c in spec[part]])
    overhead = {k: v for k, v in (spec.get("overhead") or {}).items() if k in ("cpu", "memory")} or None
    if overhead is not None:
        slim_spec["overhead"] = overhead
    # Where the pod may run: the GPU models its kind may use in the request mix (gpu_models)
    selector = spec.get("nodeSelector")
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if selector:
        slim_spec["nodeSelector"] = selector
    # The DRA claims a pod uses and its scheduling gates: what the claim allocator reads (rare; kept whole)
    claims, gates = spec.get("resourceClaims"), spec.get("schedulingGates")
    if claims:
        slim_spec["resourceClaims"] = claims
    if gates:
        slim_spec["schedulingGates"] = gates
    if required:
        slim_spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    # The containers are shared already, so their identity stands for their content (and stays alive with
    # the spec that holds them).
    spec_key = (
        "spec",
        slim_spec.get("nodeName"),
        id(slim_spec.get("initContainers")),
        id(slim_spec.get("containers")),
        tuple(sorted(overhead.items())) if overhead else None,
        slim_spec.get("schedulerName"),
        slim_spec.get("priority"),
        slim_spec.get("preemptionPolicy"),
    )
    if selector or required or claims or gates:  # pods that choose nodes or use claims keep a spec of their own
        slim: dict[str, Any] = {"metadata": slim_meta, "spec": slim_spec}
    else:
        slim = {"metadata": slim_meta, "spec": _shared(spec_key, slim_spec)}
    slim_status = _slim_status(status, deleting=bool(meta.get("deletionTimestamp")))
    if len(slim_status) == 1 and "phase" in slim_status:
        slim["status"] = _shared(("status", slim_status["phase"]), slim_status)
    elif slim_status:
        slim["status"] = slim_status
    return cast(PodBody, slim)


def _slim_status(status: Any, *, deleting: bool) -> dict[str, Any]:
    """What :func:`slim_pod` keeps of a pod's status."""
    slim_status: dict[str, Any] = {}
    if "phase" in status:
        slim_status["phase"] = sys.intern(status["phase"])
    if status.get("resourceClaimStatuses"):
        slim_status["resourceClaimStatuses"] = status["resourceClaimStatuses"]
    if status.get("nominatedNodeName"):  # a preemptor: the room freed for it is held for it
        slim_status["nominatedNodeName"] = sys.intern(str(status["nominatedNodeName"]))
    if deleting and status.get("containerStatuses"):
        slim_status["containerStatuses"] = [
            {"name": c.get("name", ""), "state": {"terminated": (c.get("state") or {}).get("terminated")}}
            for c in status["containerStatuses"]
        ]
    return slim_status


def gpu_models(pod: PodBody, label: str) -> frozenset[str] | None:
    """The GPU models a pod may run on: the values its ``nodeSelector`` or its required node affinity allow
    for the node label ``label`` (the cluster's GPU-model label, "nvidia.com/gpu.product" where NVIDIA's GPU
    Feature Discovery runs); None when it names none, or when one of its affinity terms leaves the model
    free (terms are alternatives) or excludes models (``NotIn``: what it allows depends on the cluster)."""
    if not label:
        return None
    spec: Any = pod.get("spec") or {}
    selected = (spec.get("nodeSelector") or {}).get(label)
    node_affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    allowed: set[str] | None = None
    for term in terms:
        in_term: set[str] | None = None
        for expression in (term or {}).get("matchExpressions") or []:
            if expression.get("key") != label:
                continue
            if expression.get("operator") != "In":
                in_term = None
                break
            values = set(expression.get("values") or [])
            in_term = values if in_term is None else in_term & values
        if in_term is None:
            allowed = None
            break
        allowed = in_term if allowed is None else allowed | in_term
    if selected is not None:
        allowed = {selected} if allowed is None else allowed & {selected}
    return frozenset(allowed) if allowed is not None else None


def pod_shape_problem(pod: Any) -> str | None:
    """What is structurally wrong with a pod body from an untrusted caller, in the fields the core reads;
    None if nothing. The API server never sends such a pod, but anyone who can reach the extender's port
    can, and each of these would otherwise be an exception deep in the core."""
    if not isinstance(pod, dict):
        return "'Pod' must be an object"
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        return "'Pod.metadata' must be an object"
    for key in ("name", "namespace", "uid", "resourceVersion", "deletionTimestamp"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return f"'Pod.metadata.{key}' must be a string"
    for key in ("annotations", "labels"):
        problem = _string_map(meta.get(key), f"Pod.metadata.{key}")
        if problem:
            return problem
    spec = pod.get("spec")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        return "'Pod.spec' must be an object"
    for key in ("nodeName", "schedulerName"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            return f"'Pod.spec.{key}' must be a string"
    if spec.get("overhead") is not None and not isinstance(spec["overhead"], dict):
        return "'Pod.spec.overhead' must be an object"
    for part in ("initContainers", "containers"):
        containers = spec.get(part)
        if containers is None:
            continue
        if not isinstance(containers, list):
            return f"'Pod.spec.{part}' must be a list"
        for position, container in enumerate(containers):
            where = f"Pod.spec.{part}[{position}]"
            if not isinstance(container, dict):
                return f"'{where}' must be an object"
            for key in ("name", "restartPolicy"):
                if container.get(key) is not None and not isinstance(container[key], str):
                    return f"'{where}.{key}' must be a string"
            resources = container.get("resources")
            if resources is None:
                continue
            if not isinstance(resources, dict):
                return f"'{where}.resources' must be an object"
            for kind in ("limits", "requests"):
                amounts = resources.get(kind)
                if amounts is not None and not isinstance(amounts, dict):
                    return f"'{where}.resources.{kind}' must be an object"
    status = pod.get("status")
    if status is not None and not isinstance(status, dict):
        return "'Pod.status' must be an object"
    if isinstance(status, dict):
        if status.get("phase") is not None and not isinstance(status["phase"], str):
            return "'Pod.status.phase' must be a string"
        for part in ("containerStatuses", "initContainerStatuses"):
            statuses = status.get(part)
            if statuses is not None and (
                not isinstance(statuses, list)
                or not all(isinstance(s, dict) and isinstance(s.get("state") or {}, dict) for s in statuses)
            ):
                return f"'Pod.status.{part}' must be a list of container statuses"
    return None


def _string_map(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return f"'{where}' must be an object of strings"
    return None


def priority_of(pod: PodBody) -> int:
    """The pod's priority as the API server resolved it (0 where it has none, or one that is not a number)."""
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def has_gate(pod: PodBody, name: str) -> bool:
    """Whether the pod holds the scheduling gate ``name``."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return isinstance(gates, list) and any(isinstance(g, dict) and g.get("name") == name for g in gates)
