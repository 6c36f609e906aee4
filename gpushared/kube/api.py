"""The Kubernetes calls gpushared makes, returning the API server's JSON as plain dicts.

Bodies stay dicts (never the client's model classes) so the pure core reads them directly and nothing
is lost to the models' field filtering. Every call has a timeout: a component must never hang on a slow
API server.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import kubernetes
from kubernetes.client.exceptions import ApiException

from gpushared.core.bodies import NodeBody, PodBody, meta_of, node_of

REQUEST_TIMEOUT = 10.0
#: How often the credentials are looked at again (a token file rotated, a kubeconfig token expired).
REFRESH_SECONDS = 1.0


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP status, or None when the server was not reached."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFound(KubeError):
    """404: the object does not exist (any more)."""


class Conflict(KubeError):
    """409: the object changed since it was read (a resourceVersion-guarded write lost), or already exists."""


def error_for(message: str, status: int | None) -> KubeError:
    """The KubeError for an HTTP status: NotFound and Conflict are the ones callers act on."""
    kind = {404: NotFound, 409: Conflict}.get(status or 0, KubeError)
    return kind(message, status=status)


class NoCredentials(KubeError):
    """Nothing to authenticate with yet; unlike a broken kubeconfig, this one may go away by itself."""


def connect(kubeconfig: Path | None, *, context: str | None = None) -> kubernetes.client.ApiClient:
    """A client from ``kubeconfig`` when that file exists, else the pod's in-cluster credentials."""
    config = kubernetes.client.Configuration()
    loaders = cast(Any, kubernetes.config)  # untyped module
    if kubeconfig is not None and kubeconfig.exists():
        try:
            loaders.load_kube_config(config_file=str(kubeconfig), context=context, client_configuration=config)
        except Exception as exc:  # ConfigException and YAML errors: name the file
            raise KubeError(f"kubeconfig {kubeconfig}: {exc}") from None
    elif "KUBERNETES_SERVICE_HOST" in os.environ:
        loaders.load_incluster_config(client_configuration=config)
    else:
        raise NoCredentials(f"no kubeconfig at {kubeconfig} and not running in a pod: cannot reach the API server")
    hook = config.refresh_api_key_hook
    if hook is not None:
        config.refresh_api_key_hook = _at_most_every(REFRESH_SECONDS, hook)
    return kubernetes.client.ApiClient(config)


def _at_most_every(seconds: float, hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """The client calls its credentials hook before every request, and the loaders' hooks set the host
    again each time, which makes the client read every environment variable for proxy settings: about a
    quarter of a millisecond a request in a profile, more in a pod with many Services' variables. The
    token they refresh changes once a minute at most, so looking once a second loses nothing."""
    last = -seconds

    def throttled(configuration: Any) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= seconds:
            last = now
            hook(configuration)
            configuration.refresh_api_key_hook = throttled  # the loaders' hooks put themselves back

    return throttled


def default_kubeconfig() -> Path:
    """Where kubectl looks: the first file of $KUBECONFIG, else ~/.kube/config."""
    first = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return Path(first) if first else Path.home() / ".kube" / "config"


class Api:
    """The few calls gpushared makes, as dicts in and dicts out, typed once here (``core.bodies``)."""

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.client = client
        self.core = kubernetes.client.CoreV1Api(client)

    def without_retries(self) -> Api:
        """The same credentials, but every call tried once: the client's default retries three times, each
        with the full timeout, and a caller with a deadline (the kubelet admitting a pod) cannot wait that."""
        configuration = copy.copy(self.client.configuration)
        configuration.retries = False
        return Api(kubernetes.client.ApiClient(configuration))

    def _call(self, what: str, method: Any, *args: Any, timeout: float = REQUEST_TIMEOUT, **kwargs: Any) -> Any:
        try:
            response = method(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
        except ApiException as exc:
            raise error_for(f"{what}: {exc.status} {status_message(exc.body, exc.reason)}", exc.status) from exc
        except Exception as exc:  # urllib3 and socket errors: the server was not reached
            raise KubeError(f"{what}: API server unreachable ({type(exc).__name__}: {exc})") from exc
        return json.loads(response.data or b"null")

    def get_node(self, name: str) -> NodeBody:
        return cast(NodeBody, self._call(f"get node {name}", self.core.read_node, name))

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> NodeBody:
        """Patch through /status: capacity lives there, and the main resource ignores status changes."""
        return cast(NodeBody, self._call(f"patch node {name} status", self.core.patch_node_status, name, patch))

    def list_nodes(self) -> list[NodeBody]:
        return list(self._call("list nodes", self.core.list_node).get("items") or [])

    def list_pods(self, *, node: str | None = None) -> list[PodBody]:
        """Every pod, or the pods bound to ``node`` (a field selector: the server filters)."""
        selector: dict[str, Any] = {"field_selector": f"spec.nodeName={node}"} if node else {}
        what = f"list pods on node {node}" if node else "list pods"
        return list(self._call(what, self.core.list_pod_for_all_namespaces, **selector).get("items") or [])

    def get_pod(self, namespace: str, name: str, *, timeout: float = REQUEST_TIMEOUT) -> PodBody:
        what = f"get pod {namespace}/{name}"
        return cast(PodBody, self._call(what, self.core.read_namespaced_pod, name, namespace, timeout=timeout))

    def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> PodBody:
        """A strategic-merge patch; put ``metadata.resourceVersion`` in it to make it conditional."""
        what = f"patch pod {namespace}/{name}"
        return cast(PodBody, self._call(what, self.core.patch_namespaced_pod, name, namespace, patch))

    def pod_event(self, pod: PodBody, *, reason: str, message: str, warning: bool, component: str) -> None:
        meta = meta_of(pod)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta.get('name')}.{uuid.uuid4().hex[:16]}", "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": component, "host": node_of(pod)},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self._call(
            f"event on pod {meta.get('namespace')}/{meta.get('name')}",
            self.core.create_namespaced_event,
            meta.get("namespace"),
            event,
        )


def status_message(body: bytes | str | None, reason: str | None) -> str:
    """The message of the Status an API server answered an error with, else the HTTP reason."""
    try:
        return str(json.loads(body or "{}").get("message") or reason)
    except (TypeError, ValueError, AttributeError):
        return str(reason)
