"""What the fake API server keeps, and how each write changes it, as kube-apiserver does.

Objects by (plural, namespace, name), a resourceVersion bumped on every write (409 Conflict on a stale
one), the history of changes that watches replay from (compacted past ``history`` events), JSON / merge /
strategic-merge patches, the status subresource (writes to the main resource keep the old status, writes
to /status keep the old spec), ``pods/binding`` (409 when already bound, the Binding's annotations copied
onto the pod), graceful deletion of bound pods. No HTTP and no faults here: ``tests.fakes.apiserver``.
"""

from __future__ import annotations

import bisect
import datetime
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.fakes.dra import Invalid, check_claim_status_update
from tests.fakes.patches import PatchError, json_patch, merge_patch, strategic_merge_patch
from tests.fakes.selectors import SelectorError, field_selector, label_selector


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    has_status: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES = {
    r.plural: r
    for r in (
        Resource("", "v1", "pods", "Pod", namespaced=True, has_status=True),
        Resource("", "v1", "nodes", "Node", namespaced=False, has_status=True),
        Resource("", "v1", "events", "Event", namespaced=True),
        Resource("", "v1", "configmaps", "ConfigMap", namespaced=True),
        Resource("", "v1", "namespaces", "Namespace", namespaced=False, has_status=True),
        Resource("", "v1", "serviceaccounts", "ServiceAccount", namespaced=True),
        Resource("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True),
        Resource("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", namespaced=False),
        Resource("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", namespaced=True, has_status=True),
        Resource("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", namespaced=True),
        Resource("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", namespaced=False),
        Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
        Resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
        Resource("rbac.authorization.k8s.io", "v1", "roles", "Role", namespaced=True),
        Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", namespaced=True),
        Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", namespaced=True, has_status=True),
    )
}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        return status_body(self.code, self.reason, self.message)


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


#: A check of one write by who asks for it: given the stored object and the one to store, raises ApiError.
Guard = Callable[[dict[str, Any], dict[str, Any]], None]

REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass
class Event:
    """One change, as the history keeps it for watches to replay."""

    rv: int
    type: str
    plural: str
    obj: dict[str, Any]
    old: dict[str, Any] | None
    #: when it was stored (``time.monotonic``): a lagging watch shows it only some time after
    at: float = 0.0


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clone(obj: Any) -> Any:
    """A copy of a JSON tree (dicts, lists, scalars): every stored object came in as JSON. A third of
    ``copy.deepcopy``'s time, which was a third of this fake's CPU per write in the extender benchmark."""
    kind = type(obj)
    if kind is dict:
        return {key: clone(value) for key, value in obj.items()}
    if kind is list:
        return [clone(value) for value in obj]
    return obj


class Store:
    """The objects, their resourceVersions and the history of changes, under one lock; each write as
    kube-apiserver carries it out. The server (``FakeApiServer``) routes requests here and streams the
    history to watches."""

    def __init__(self, *, history: int) -> None:
        self.lock = threading.RLock()
        #: notified on every change, and when a watch must look at its flags again
        self.changed = threading.Condition(self.lock)
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        # Versions start above 0: a watch from "0" means "from now, with the current objects replayed".
        self._rv = itertools.count(2)
        self.current_rv = 1
        self.events: list[Event] = []
        self.history = history
        self.compacted_rv = 0

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects.get((plural, namespace, name))
            return clone(obj) if obj is not None else None

    def read(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            return clone(self.current(resource, namespace, name))

    def all(self, plural: str) -> list[dict[str, Any]]:
        with self.lock:
            return [clone(o) for (p, _, _), o in sorted(self.objects.items()) if p == plural]

    def compact(self) -> None:
        """Forget the event history: a watch resuming from an older resourceVersion gets 410 Gone."""
        with self.lock:
            self.events.clear()
            self.compacted_rv = self.current_rv

    def _commit(
        self,
        resource: Resource,
        kind: str,
        key: tuple[str, str, str],
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Store (or delete) under the lock, bump resourceVersion, record the event, wake watchers."""
        rv = next(self._rv)
        self.current_rv = rv
        if obj is None:
            assert old is not None
            gone = clone(old)
            gone["metadata"]["resourceVersion"] = str(rv)
            del self.objects[key]
            event = Event(rv, "DELETED", resource.plural, gone, old, time.monotonic())
            result = gone
        else:
            obj["metadata"]["resourceVersion"] = str(rv)
            self.objects[key] = obj
            event = Event(rv, kind, resource.plural, clone(obj), old, time.monotonic())
            result = obj
        self.events.append(event)
        if len(self.events) > self.history:
            dropped = self.events[: len(self.events) - self.history]
            self.compacted_rv = dropped[-1].rv
            del self.events[: len(dropped)]
        self.changed.notify_all()
        return clone(result)

    def create(self, resource: Resource, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", f"{resource.kind} is invalid: metadata.name: Required value")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if resource.namespaced:
            if meta.get("namespace", namespace) != namespace:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the object does not match the namespace on the request",
                )
            meta["namespace"] = namespace
        body["apiVersion"], body["kind"] = resource.api_version, resource.kind
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now())
        meta.pop("resourceVersion", None)
        if resource.plural == "pods":
            body.setdefault("spec", {}).setdefault("terminationGracePeriodSeconds", 30)
            body.setdefault("status", {}).setdefault("phase", "Pending")
        key = (resource.plural, namespace, meta["name"])
        with self.lock:
            if key in self.objects:
                raise ApiError(409, "AlreadyExists", f'{resource.plural} "{meta["name"]}" already exists')
            return self._commit(resource, "ADDED", key, body, None)

    def current(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        obj = self.objects.get((resource.plural, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{resource.plural} "{name}" not found')
        return obj

    def update(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        new: dict[str, Any],
        *,
        subresource: str,
        precondition_rv: str | None,
        guard: Guard | None = None,
    ) -> dict[str, Any]:
        """Store ``new`` in place of the current object, keeping what this endpoint may not change.
        ``guard`` (old, new) refuses a write by raising ApiError, under the lock (the caller's permissions)."""
        with self.lock:
            old = self.current(resource, namespace, name)
            current_rv = old["metadata"]["resourceVersion"]
            if precondition_rv and precondition_rv != current_rv:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {resource.plural} "{name}": '
                    "the object has been modified; "
                    "please apply your changes to the latest version and try again",
                )
            new = clone(new)
            meta = new.setdefault("metadata", {})
            if meta.get("uid") not in (None, old["metadata"]["uid"]):
                raise _uid_conflict(meta["uid"], old["metadata"]["uid"])
            for immutable in ("name", "namespace", "uid", "creationTimestamp"):
                if immutable in old["metadata"]:
                    meta[immutable] = old["metadata"][immutable]
            if old["metadata"].get("deletionTimestamp"):
                meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
                meta["deletionGracePeriodSeconds"] = old["metadata"].get("deletionGracePeriodSeconds")
            new["apiVersion"], new["kind"] = resource.api_version, resource.kind
            if resource.has_status:
                if subresource == "status":
                    new["spec"] = clone(old.get("spec"))
                else:
                    new["status"] = clone(old.get("status"))
            if resource.plural == "pods" and subresource != "status":
                _check_pod_spec_update(old.get("spec") or {}, new.get("spec") or {})
            if resource.plural == "resourceclaims" and subresource == "status":
                try:
                    check_claim_status_update(name, old.get("status") or {}, new.get("status") or {})
                except Invalid as exc:
                    raise ApiError(422, "Invalid", str(exc)) from None
            if guard is not None:
                guard(old, new)
            if new == old:
                return clone(old)  # a no-op write does not bump resourceVersion
            return self._commit(resource, "MODIFIED", (resource.plural, namespace, name), new, clone(old))

    def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        body: bytes,
        content_type: str,
        *,
        subresource: str,
        guard: Guard | None = None,
    ) -> dict[str, Any]:
        try:
            patch = json.loads(body or b"null")
        except json.JSONDecodeError as exc:
            raise ApiError(400, "BadRequest", f"invalid JSON in patch: {exc}") from None
        with self.lock:
            current = clone(self.current(resource, namespace, name))
            try:
                if content_type == "application/json-patch+json":
                    patched = json_patch(current, patch)
                elif content_type == "application/merge-patch+json":
                    patched = merge_patch(current, patch)
                elif content_type == "application/strategic-merge-patch+json":
                    patched = strategic_merge_patch(current, patch)
                else:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "the body of the request was in an unknown format - accepted media types include: "
                        "application/json-patch+json, application/merge-patch+json, "
                        f"application/strategic-merge-patch+json (got {content_type})",
                    )
            except PatchError as exc:
                raise ApiError(exc.status, REASONS[exc.status], str(exc)) from None
            if not isinstance(patched, dict):
                raise ApiError(422, "Invalid", "the patch did not produce an object")
            wanted_rv = (patched.get("metadata") or {}).get("resourceVersion")
            return self.update(
                resource, namespace, name, patched, subresource=subresource, precondition_rv=wanted_rv, guard=guard
            )

    def delete(self, resource: Resource, namespace: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            old = self.current(resource, namespace, name)
            preconditions = options.get("preconditions") or {}
            if preconditions.get("uid") not in (None, old["metadata"]["uid"]):
                raise _uid_conflict(preconditions["uid"], old["metadata"]["uid"])
            if preconditions.get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
                raise ApiError(409, "Conflict", "Precondition failed: resourceVersion in precondition does not match")
            key = (resource.plural, namespace, name)
            grace = options.get("gracePeriodSeconds")
            if resource.plural == "pods" and (old.get("spec") or {}).get("nodeName"):
                if grace is None:
                    grace = old["metadata"].get(
                        "deletionGracePeriodSeconds", old["spec"].get("terminationGracePeriodSeconds", 30)
                    )
                if grace > 0:
                    # A bound pod is only marked; its kubelet stops the containers, then deletes with grace 0.
                    terminating = clone(old)
                    if terminating["metadata"].get("deletionTimestamp") is None:
                        terminating["metadata"]["deletionTimestamp"] = now()
                    terminating["metadata"]["deletionGracePeriodSeconds"] = grace
                    if terminating == old:
                        return clone(old)
                    return self._commit(resource, "MODIFIED", key, terminating, clone(old))
            return self._commit(resource, "DELETED", key, None, clone(old))

    def bind(self, namespace: str, name: str, binding: dict[str, Any]) -> dict[str, Any]:
        pods = RESOURCES["pods"]
        target = (binding.get("target") or {}).get("name")
        if not target:
            raise ApiError(422, "Invalid", "Binding is invalid: target.name: Required value")
        with self.lock:
            pod = self.current(pods, namespace, name)
            meta = binding.get("metadata") or {}
            if meta.get("uid") not in (None, "", pod["metadata"]["uid"]):
                raise _uid_conflict(meta["uid"], pod["metadata"]["uid"])
            if pod["metadata"].get("deletionTimestamp"):
                raise ApiError(409, "Conflict", f"pod {name} is being deleted, cannot be assigned to a host")
            if (pod.get("spec") or {}).get("nodeName"):
                raise ApiError(409, "Conflict", f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
            if (pod.get("spec") or {}).get("schedulingGates"):
                # BindingREST returns a plain error here, which the API server answers as an internal error.
                raise ApiError(500, "InternalError", f"pod {name} has non-empty .spec.schedulingGates")
            bound = clone(pod)
            bound["spec"]["nodeName"] = target
            if meta.get("annotations"):
                bound["metadata"].setdefault("annotations", {}).update(meta["annotations"])
            conditions = [c for c in bound["status"].get("conditions") or [] if c.get("type") != "PodScheduled"]
            conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": now()})
            bound["status"]["conditions"] = conditions
            self._commit(pods, "MODIFIED", ("pods", namespace, name), bound, clone(pod))
        return status_body(201, "", "")

    def list_page(self, resource: Resource, namespace: str | None, query: dict[str, str]) -> dict[str, Any]:
        try:
            fields = field_selector(query.get("fieldSelector"), plural=resource.plural)
            labels = label_selector(query.get("labelSelector"))
        except SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from None
        limit = int(query.get("limit") or 0)
        start = int(query["continue"]) if query.get("continue") else 0
        meta: dict[str, Any] = {}
        with self.lock:
            selected = [
                obj
                for (plural, ns, _), obj in sorted(self.objects.items())
                if plural == resource.plural and (namespace is None or ns == namespace) and fields(obj) and labels(obj)
            ]
            if limit:
                if start + limit < len(selected):
                    meta["continue"] = str(start + limit)
                    meta["remainingItemCount"] = len(selected) - start - limit
                selected = selected[start : start + limit]
            items = [clone(obj) for obj in selected]  # only the page: a 150k-pod list is 300 pages
            meta["resourceVersion"] = str(self.current_rv)
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": meta,
            "items": items,
        }

    def events_after(self, since: int, plural: str) -> list[Event]:
        """History is in resourceVersion order: find the start by bisection, not by scanning all of it
        on every wake of every watch (which made benchmarks with 100k objects measure this fake)."""
        start = bisect.bisect_right(self.events, since, key=lambda e: e.rv)
        return [e for e in self.events[start:] if e.plural == plural]


def _uid_conflict(wanted: str, actual: str) -> ApiError:
    return ApiError(
        409, "Conflict", f"Precondition failed: UID in precondition: {wanted}, UID in object meta: {actual}"
    )


def _check_pod_spec_update(old: dict[str, Any], new: dict[str, Any]) -> None:
    """kube-apiserver lets an update change only images, activeDeadlineSeconds and tolerations of a pod, and
    remove scheduling gates, never add one (``validateSchedulingGates``: gates are set when a pod is created)."""
    names = [gate.get("name") for gate in old.get("schedulingGates") or []]
    for gate in new.get("schedulingGates") or []:
        if gate.get("name") not in names:
            raise ApiError(
                422,
                "Invalid",
                "Pod is invalid: spec.schedulingGates: Forbidden: only deletion is allowed, "
                f"but found new scheduling gate '{gate.get('name')}'",
            )
    gated = bool(old.get("schedulingGates"))
    old = {k: v for k, v in old.items() if k != "schedulingGates"}
    new = {k: v for k, v in new.items() if k != "schedulingGates"}
    if gated:  # KEP-3838: a gated pod's node affinity may change (the required terms only by additions)
        old_affinity = (old.get("affinity") or {}).get("nodeAffinity")
        new_affinity = (new.get("affinity") or {}).get("nodeAffinity")
        if old_affinity != new_affinity:
            _check_node_affinity_mutation(old_affinity, new_affinity)
            new = clone(new)
            rest = {k: v for k, v in (new.get("affinity") or {}).items() if k != "nodeAffinity"}
            if old_affinity is not None:
                rest["nodeAffinity"] = old_affinity
            if rest or "affinity" in old:
                new["affinity"] = rest
            else:
                new.pop("affinity", None)
    comparable_old = clone(old)
    for field_name in ("containers", "initContainers"):
        for old_c, new_c in zip(comparable_old.get(field_name) or [], new.get(field_name) or [], strict=False):
            if "image" in new_c:
                old_c["image"] = new_c["image"]
    for mutable in ("activeDeadlineSeconds", "tolerations"):
        comparable_old.pop(mutable, None)
    comparable_new = {k: v for k, v in new.items() if k not in ("activeDeadlineSeconds", "tolerations")}
    if comparable_old != comparable_new:
        raise ApiError(
            422,
            "Invalid",
            "Pod is invalid: spec: Forbidden: pod updates may not change fields other than "
            "`spec.containers[*].image`, `spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, "
            "`spec.tolerations` (only additions to existing tolerations)",
        )


def _check_node_affinity_mutation(old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
    """kube-apiserver's ``validateNodeAffinityMutation``: with required terms before, the same number of them
    after, each only with expressions and fields added; the preferred terms may change freely."""
    required = (old or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    old_terms = (required or {}).get("nodeSelectorTerms") or []
    if not old_terms:
        return
    new_terms = ((new or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    only_added = len(new_terms) == len(old_terms) and all(
        (n.get(part) or [])[: len(o.get(part) or [])] == (o.get(part) or [])
        for o, n in zip(old_terms, new_terms, strict=True)
        for part in ("matchExpressions", "matchFields")
    )
    if not only_added:
        raise ApiError(
            422,
            "Invalid",
            "Pod is invalid: spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution: Invalid "
            "value: only additions to the terms' expressions and fields are allowed for a gated pod",
        )


def plural_of(obj: dict[str, Any]) -> str:
    for resource in RESOURCES.values():
        if resource.kind == obj.get("kind"):
            return resource.plural
    raise ValueError(f"unknown kind {obj.get('kind')!r}")
