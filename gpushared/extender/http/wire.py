"""The JSON of kube-scheduler's extender API (``k8s.io/kube-scheduler/extender/v1``).

Those Go structs carry no JSON tags, so kube-scheduler writes the Go field names (``Pod``, ``NodeNames``,
``FailedNodes``, ``PodUID``, ``Host``...) and Go's decoder matches keys case-insensitively. We read the
top-level keys in any case and write exactly the Go names. The pod and nodes inside are ordinary
Kubernetes JSON (camelCase tags) and pass through untouched.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any, cast

import orjson

from gpushared.core.shared.bodies import NodeBody, PodBody, meta_of, pod_shape_problem

#: The most candidate nodes one request may name. kube-scheduler sends at most every node of the cluster
#: (Kubernetes is tested to 5,000; some managed clusters run 15,000); more only holds the event loop.
MAX_NODES = 15_000
#: Kubernetes' name rules: a namespace is a DNS-1123 label, pod and node names DNS-1123 subdomains.
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_UID = re.compile(r"[A-Za-z0-9][-A-Za-z0-9]{0,127}")


class WireError(ValueError):
    """A request body that is not what kube-scheduler sends; answered with HTTP 400 and this message."""


def _parsed(body: bytes, what: str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # invalid UTF-8 included
        raise WireError(f"{what}: body is not JSON ({exc})") from None


def _object(body: bytes, what: str) -> dict[str, Any]:
    """A Go struct's JSON: keys matched in any case, as Go's decoder matches them."""
    value = _parsed(body, what)
    if not isinstance(value, dict):
        raise WireError(f"{what}: body must be a JSON object")
    return {str(k).lower(): v for k, v in value.items()}


@dataclass(frozen=True)
class ExtenderArgs:
    #: typed once its shape is checked (``pod_shape_problem``): the core reads it as any pod
    pod: PodBody
    node_names: list[str] | None  # nodeCacheCapable: true
    nodes: list[NodeBody] | None  # nodeCacheCapable: false

    @property
    def names(self) -> list[str]:
        if self.node_names is not None:
            return self.node_names
        return [meta_of(n).get("name", "") for n in self.nodes or []]


def parse_args(body: bytes, *, verb: str, max_nodes: int = MAX_NODES) -> ExtenderArgs:
    fields = _object(body, verb)
    pod = fields.get("pod")
    if not isinstance(pod, dict) or not isinstance(pod.get("metadata"), dict):
        raise WireError(f"{verb}: 'Pod' must be a Kubernetes Pod object")
    problem = pod_shape_problem(pod)
    if problem:
        raise WireError(f"{verb}: {problem}")
    names = fields.get("nodenames")
    nodes = fields.get("nodes")
    # set(map(type, ...)): checked in C; kube-scheduler sends hundreds of names with every pod
    if names is not None and (not isinstance(names, list) or not set(map(type, names)) <= {str}):
        raise WireError(f"{verb}: 'NodeNames' must be a list of node names")
    items = None
    if nodes is not None:
        items = nodes.get("items") if isinstance(nodes, dict) else None
        if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
            raise WireError(f"{verb}: 'Nodes' must be a NodeList with 'items'")
        if not all(isinstance(n.get("metadata") or {}, dict) for n in items):
            raise WireError(f"{verb}: each of 'Nodes.items' must have an object 'metadata'")
    if names is None and items is None:
        raise WireError(f"{verb}: neither 'NodeNames' nor 'Nodes' given")
    count = len(names) if names is not None else len(items or ())
    if count > max_nodes:
        raise WireError(f"{verb}: {count} candidate nodes, more than the {max_nodes} one request may name")
    return ExtenderArgs(pod=cast(PodBody, pod), node_names=names, nodes=items)


def filter_result(
    args: ExtenderArgs | None, *, passed: list[str], failed: dict[str, str], error: str = ""
) -> dict[str, Any]:
    """ExtenderFilterResult: the passing nodes in the form they came in (names or full Nodes)."""
    if args is not None and args.node_names is None and args.nodes is not None:
        keep = set(passed)
        kept = [n for n in args.nodes if meta_of(n).get("name") in keep]
        return {
            "Nodes": {"metadata": {}, "items": kept},
            "NodeNames": None,
            "FailedNodes": failed,
            "FailedAndUnresolvableNodes": {},
            "Error": error,
        }
    return {"Nodes": None, "NodeNames": passed, "FailedNodes": failed, "FailedAndUnresolvableNodes": {}, "Error": error}


def priority_list(scores: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """HostPriorityList."""
    return [{"Host": host, "Score": score} for host, score in scores]


@dataclass(frozen=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


def parse_binding(body: bytes) -> BindingArgs:
    """The names go into API URLs: each must be what Kubernetes allows for it (and is quoted there too)."""
    fields = _object(body, "bind")
    values = {}
    for key, go, pattern, most, rule in (
        ("podname", "PodName", _SUBDOMAIN, 253, "a DNS-1123 subdomain"),
        ("podnamespace", "PodNamespace", _LABEL, 63, "a DNS-1123 label"),
        ("poduid", "PodUID", _UID, 128, "a UID"),
        ("node", "Node", _SUBDOMAIN, 253, "a DNS-1123 subdomain"),
    ):
        value = fields.get(key)
        if not isinstance(value, str) or not value:
            raise WireError(f"bind: '{go}' must be a non-empty string")
        if len(value) > most or not pattern.fullmatch(value):
            raise WireError(f"bind: '{go}' {value[:64]!r} is not {rule}")
        values[key] = value
    return BindingArgs(values["podname"], values["podnamespace"], values["poduid"], values["node"])


def binding_result(error: str = "") -> dict[str, Any]:
    return {"Error": error}


# --- preemption -------------------------------------------------------------------------------------------------

#: The most victims kube-scheduler names on one node: a node runs at most a few hundred pods.
MAX_VICTIMS = 1_000


@dataclass(frozen=True)
class PreemptionArgs:
    """ExtenderPreemptionArgs: the pod that fits nowhere, and for each node kube-scheduler would preempt on,
    the pods it chose to evict there (by UID; the whole pods when the extender is not nodeCacheCapable) and
    how many of them its PodDisruptionBudgets would be violated by."""

    pod: PodBody
    victims: dict[str, tuple[str, ...]]
    pdb_violations: dict[str, int]


def parse_preemption(body: bytes, *, max_nodes: int = MAX_NODES) -> PreemptionArgs:
    fields = _object(body, "preempt")
    pod = fields.get("pod")
    if not isinstance(pod, dict) or not isinstance(pod.get("metadata"), dict):
        raise WireError("preempt: 'Pod' must be a Kubernetes Pod object")
    problem = pod_shape_problem(pod)
    if problem:
        raise WireError(f"preempt: {problem}")
    meta, whole = fields.get("nodenametometavictims"), fields.get("nodenametovictims")
    given = meta if meta is not None else whole
    if given is None:
        return PreemptionArgs(cast(PodBody, pod), {}, {})
    if not isinstance(given, dict):
        raise WireError("preempt: 'NodeNameToMetaVictims' must map node names to victims")
    if len(given) > max_nodes:
        raise WireError(f"preempt: {len(given)} nodes, more than the {max_nodes} one request may name")
    victims: dict[str, tuple[str, ...]] = {}
    violations: dict[str, int] = {}
    for node, entry in given.items():
        if not isinstance(entry, dict):
            raise WireError(f"preempt: the victims on node {str(node)[:64]!r} must be an object")
        keyed = {str(k).lower(): v for k, v in entry.items()}
        pods = keyed.get("pods") or []
        if not isinstance(pods, list) or len(pods) > MAX_VICTIMS or not all(isinstance(p, dict) for p in pods):
            raise WireError(f"preempt: 'Pods' on node {str(node)[:64]!r} must be a list of at most {MAX_VICTIMS}")
        uids = tuple(_victim_uid(p, whole=meta is None) for p in pods)
        count = keyed.get("numpdbviolations") or 0
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise WireError(f"preempt: 'NumPDBViolations' on node {str(node)[:64]!r} must be a count")
        victims[str(node)] = uids
        violations[str(node)] = count
    return PreemptionArgs(cast(PodBody, pod), victims, violations)


def _victim_uid(item: dict[str, Any], *, whole: bool) -> str:
    """A MetaPod's ``UID``, or a whole pod's ``metadata.uid``."""
    if whole:
        uid = (item.get("metadata") or {}).get("uid") if isinstance(item.get("metadata"), dict) else None
    else:
        uid = next((v for k, v in item.items() if str(k).lower() == "uid"), None)
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise WireError("preempt: each victim must name a pod UID")
    return uid


def preemption_result(victims: dict[str, tuple[tuple[str, ...], int]]) -> dict[str, Any]:
    """ExtenderPreemptionResult: for each node the extender keeps, the pods to evict there (MetaPods, by UID)
    and how many PodDisruptionBudgets that violates. A node left out is not preempted on."""
    return {
        "NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": violations}
            for node, (uids, violations) in victims.items()
        }
    }


# --- the mutating admission webhook (core/placement/admission.py decides) -------------------------------------------

#: The AdmissionReview versions the API server may send (``admissionReviewVersions``); the answer is in the
#: version asked. 1.16+ send v1; v1beta1 is kept for configurations that still list it first.
ADMISSION_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")


@dataclass(frozen=True)
class AdmissionRequest:
    api_version: str
    uid: str
    operation: str
    kind: str
    #: the namespace the object is created in (its metadata may not say yet)
    namespace: str
    #: the object being created; a Pod once ``kind`` says so (its shape checked by ``pod_shape_problem``)
    pod: PodBody | None


def parse_admission_review(body: bytes) -> AdmissionRequest:
    """An AdmissionReview from the API server. These keys are camelCase JSON tags, matched exactly."""
    review = _parsed(body, "mutate")
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise WireError("mutate: body must be an AdmissionReview")
    api_version = review.get("apiVersion")
    if api_version not in ADMISSION_VERSIONS:
        raise WireError(f"mutate: apiVersion {str(api_version)[:64]!r} is not one of {', '.join(ADMISSION_VERSIONS)}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise WireError("mutate: 'request' must be an object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid or len(uid) > 128:
        raise WireError("mutate: 'request.uid' must be a non-empty string")
    kind = request.get("kind")
    kind_name = kind.get("kind") if isinstance(kind, dict) else None
    operation = request.get("operation")
    if not isinstance(kind_name, str) or not isinstance(operation, str):
        raise WireError("mutate: 'request.kind.kind' and 'request.operation' must be strings")
    pod = None
    if kind_name == "Pod":
        obj = request.get("object")
        problem = pod_shape_problem(obj)
        if problem is not None:
            raise WireError(f"mutate: 'request.object' {problem}")
        pod = cast(PodBody, obj)
    namespace = request.get("namespace")
    return AdmissionRequest(
        str(api_version), uid, operation, kind_name, namespace if isinstance(namespace, str) else "", pod
    )


def admission_response(request: AdmissionRequest, patch: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """Allowed, with the patch if there is one: the webhook never refuses a pod."""
    response: dict[str, Any] = {"uid": request.uid, "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(orjson.dumps(list(patch))).decode()
    return {"apiVersion": request.api_version, "kind": "AdmissionReview", "response": response}
