"""The Kubernetes calls gpushared makes, returning the API server's JSON as plain dicts.

Bodies stay dicts (never a client library's model classes) so the pure core reads them directly and
nothing is lost to a model's field filtering. Every call has a timeout: a component must never hang on a slow
API server.
"""

from __future__ import annotations

import datetime
import os
import uuid
from pathlib import Path
from typing import Any, cast

from gpushared.core.shared.bodies import NodeBody, PodBody, meta_of, node_of
from gpushared.kube import kubeconfig as kubeconfig_module
from gpushared.kube.errors import Conflict, KubeError, NoCredentials, NotFound, error_for, status_message
from gpushared.kube.rest import REQUEST_TIMEOUT, Rest, pod_path, quoted

__all__ = [
    "REQUEST_TIMEOUT",
    "Api",
    "Conflict",
    "KubeError",
    "NoCredentials",
    "NotFound",
    "connect",
    "default_kubeconfig",
    "error_for",
    "status_message",
]

STRATEGIC_MERGE = "application/strategic-merge-patch+json"


def connect(kubeconfig: Path | None, *, context: str | None = None) -> Rest:
    """A client from ``kubeconfig`` when that file exists, else the pod's in-cluster credentials."""
    return Rest(kubeconfig_module.load(kubeconfig, context=context))


def default_kubeconfig() -> Path:
    """Where kubectl looks: the first file of $KUBECONFIG, else ~/.kube/config."""
    first = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return Path(first) if first else Path.home() / ".kube" / "config"


class Api:
    """The few calls gpushared makes, as dicts in and dicts out, typed once here (``core.shared.bodies``)."""

    def __init__(self, rest: Rest) -> None:
        self.rest = rest

    def without_retries(self) -> Api:
        """The same credentials, but every call tried once: by default a broken connection is tried three
        times, each with the full timeout, and a caller with a deadline (the kubelet admitting a pod) cannot
        wait that."""
        return Api(self.rest.without_retries())

    def get_node(self, name: str) -> NodeBody:
        return cast(NodeBody, self.rest.request(f"get node {name}", "GET", f"/api/v1/nodes/{quoted(name)}"))

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> NodeBody:
        """Patch through /status: capacity lives there, and the main resource ignores status changes."""
        path = f"/api/v1/nodes/{quoted(name)}/status"
        what = f"patch node {name} status"
        return cast(NodeBody, self.rest.request(what, "PATCH", path, body=patch, content_type=STRATEGIC_MERGE))

    def list_nodes(self) -> list[NodeBody]:
        return list(self.rest.request("list nodes", "GET", "/api/v1/nodes").get("items") or [])

    def list_pods(self, *, node: str | None = None) -> list[PodBody]:
        """Every pod, or the pods bound to ``node`` (a field selector: the server filters)."""
        query = {"fieldSelector": f"spec.nodeName={node}"} if node else None
        what = f"list pods on node {node}" if node else "list pods"
        return list(self.rest.request(what, "GET", "/api/v1/pods", query=query).get("items") or [])

    def get_pod(self, namespace: str, name: str, *, timeout: float = REQUEST_TIMEOUT) -> PodBody:
        what = f"get pod {namespace}/{name}"
        return cast(PodBody, self.rest.request(what, "GET", pod_path(namespace, name), timeout=timeout))

    def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> PodBody:
        """A strategic-merge patch; put ``metadata.resourceVersion`` in it to make it conditional."""
        what = f"patch pod {namespace}/{name}"
        path = pod_path(namespace, name)
        return cast(PodBody, self.rest.request(what, "PATCH", path, body=patch, content_type=STRATEGIC_MERGE))

    def request_token(self, namespace: str, service_account: str, *, seconds: int) -> str:
        """A new token for a ServiceAccount (the TokenRequest API, 1.22+ GA); the API server may shorten
        ``seconds`` (its --service-account-max-token-expiration)."""
        path = f"/api/v1/namespaces/{quoted(namespace)}/serviceaccounts/{quoted(service_account)}/token"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": seconds},
        }
        answer = self.rest.request(f"token for {namespace}/{service_account}", "POST", path, body=body)
        token = (answer.get("status") or {}).get("token") if isinstance(answer, dict) else None
        if not isinstance(token, str) or not token:
            raise KubeError(f"token for {namespace}/{service_account}: the answer holds no token")
        return token

    def server_version(self, *, timeout: float = REQUEST_TIMEOUT) -> tuple[int, int] | None:
        """The API server's (major, minor) from ``/version`` (a minor of "21+" is 21); None if not read."""
        try:
            answer = self.rest.request("get the API server's version", "GET", "/version", timeout=timeout)
            return int(str(answer["major"]).rstrip("+")), int(str(answer["minor"]).rstrip("+"))
        except (KubeError, KeyError, TypeError, ValueError):
            return None

    def node_event(self, node: str, *, reason: str, message: str, warning: bool, component: str) -> None:
        """An Event on a Node (in namespace default, where the kubelet writes its own)."""
        involved = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}
        what = f"event on node {node}"
        self._event(
            what, "default", node, involved, reason=reason, message=message, warning=warning, component=component
        )

    def pod_event(self, pod: PodBody, *, reason: str, message: str, warning: bool, component: str) -> None:
        meta = meta_of(pod)
        namespace = str(meta.get("namespace") or "")
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        }
        what = f"event on pod {namespace}/{meta.get('name')}"
        self._event(
            what,
            namespace,
            node_of(pod),
            involved,
            reason=reason,
            message=message,
            warning=warning,
            component=component,
        )

    def _event(
        self,
        what: str,
        namespace: str,
        host: str | None,
        involved: dict[str, Any],
        *,
        reason: str,
        message: str,
        warning: bool,
        component: str,
    ) -> None:
        """One Event about ``involved``, written in ``namespace``, reported from ``host``."""
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{involved.get('name')}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": component, "host": host},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.rest.request(what, "POST", f"/api/v1/namespaces/{quoted(namespace)}/events", body=event)
