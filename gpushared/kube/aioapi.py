"""The extender's bind calls on its event loop: reading a pod and creating its Binding, with aiohttp.

kube-scheduler binds pods while it filters the next ones, so the extender's binds are its hot path. Through
the generated client each call takes a worker thread, urllib3 and the client's own serialisation (what that
cost: docs/benchmarks.md, "Figures behind the code"); here it is one coroutine on the loop. The credentials
are the synchronous client's (``kube.credentials``: certificates, CA, the token and its refresh, proxy), so
the two authenticate the same way.
"""

from __future__ import annotations

import ssl
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp

from gpushared.core.placement.reservations import BINDING_TIMEOUT_SECONDS
from gpushared.core.shared.bodies import PodBody
from gpushared.kube import jsonio
from gpushared.kube.credentials import Credentials, Identity
from gpushared.kube.errors import KubeError, error_for, status_message
from gpushared.kube.rest import REQUEST_TIMEOUT, pod_path, quoted, request_headers


class AsyncApi:
    """Pods read and bound over one pool of keep-alive connections; open it on the loop that uses it."""

    def __init__(self, credentials: Credentials, *, connections: int = 32) -> None:
        self.credentials = credentials
        self.host = credentials.server
        self.connections = connections
        self.proxy = credentials.proxy
        if self.proxy and urlsplit(self.proxy).scheme != "http":
            raise KubeError(f"proxy {self.proxy}: the extender reaches the API server through http:// proxies only")
        #: what every request passes beside its own arguments: the proxy, and the name the TLS server must have
        self._options: dict[str, Any] = {"proxy": self.proxy}
        if credentials.https and credentials.tls_server_name:
            self._options["server_hostname"] = credentials.tls_server_name
        self._session: aiohttp.ClientSession | None = None
        self._identity: Identity | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_pod(self, namespace: str, name: str) -> PodBody:
        return cast(PodBody, await self._call(f"get pod {namespace}/{name}", "GET", pod_path(namespace, name)))

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        *,
        uid: str,
        node: str,
        annotations: dict[str, str],
        deadline: float = BINDING_TIMEOUT_SECONDS,
    ) -> None:
        """Create the pod's Binding; the UID makes it fail if the pod was deleted and re-created meanwhile.
        kube-apiserver copies the Binding's annotations onto the pod in the write that sets its node.
        ``deadline`` (seconds) goes with it as ``?timeout=``: from 1.21 the API server applies it by then
        or never (its request deadline reaches the storage write), which bounds how long after this
        process dies its Bindings can still land."""
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "annotations": annotations},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self._call(
            f"bind pod {namespace}/{name} to {node}",
            "POST",
            pod_path(namespace, name) + f"/binding?timeout={deadline:g}s",
            binding,
            timeout=deadline + 1.0,
        )

    async def put_claim_status(self, body: dict[str, Any]) -> dict[str, Any]:
        """Write a ResourceClaim's status as ``body`` has it. Its ``metadata.resourceVersion`` guards the
        write: a claim changed since it was read (another allocator's write) fails with 409."""
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
        path = f"/apis/resource.k8s.io/v1/namespaces/{quoted(namespace)}/resourceclaims/{quoted(name)}/status"
        return cast(
            dict[str, Any], await self._call(f"write the status of claim {namespace}/{name}", "PUT", path, body)
        )

    async def put_claim(self, body: dict[str, Any]) -> dict[str, Any]:
        """Write a ResourceClaim (its metadata: the finalizer), guarded by ``metadata.resourceVersion`` (409)."""
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
        path = f"/apis/resource.k8s.io/v1/namespaces/{quoted(namespace)}/resourceclaims/{quoted(name)}"
        return cast(dict[str, Any], await self._call(f"write claim {namespace}/{name}", "PUT", path, body))

    async def evict_pod(self, namespace: str, name: str, *, uid: str, policy_v1: bool = True) -> None:
        """Evict a pod through the Eviction API: refused (429) while a PodDisruptionBudget that selects it
        allows no disruption; the UID makes it fail if the pod was deleted and made again meanwhile.
        ``policy_v1``: the Eviction's version (policy/v1 from Kubernetes 1.22, policy/v1beta1 before)."""
        eviction = {
            "apiVersion": "policy/v1" if policy_v1 else "policy/v1beta1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        await self._call(f"evict pod {namespace}/{name}", "POST", pod_path(namespace, name) + "/eviction", eviction)

    async def json_patch_pod(self, namespace: str, name: str, operations: list[dict[str, Any]]) -> PodBody:
        """Apply a JSON Patch (RFC 6902) to a pod: its ``test`` operations make it all or nothing."""
        return cast(
            PodBody,
            await self._call(
                f"patch pod {namespace}/{name}",
                "PATCH",
                pod_path(namespace, name),
                operations,
                content_type="application/json-patch+json",
            ),
        )

    async def _call(
        self,
        what: str,
        method: str,
        path: str,
        body: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        timeout: float | None = None,
        content_type: str = "application/json",
    ) -> Any:
        credential = self.credentials.credential
        try:
            identity = credential.identity()
            authorization = credential.authorization()
        except KubeError as exc:
            raise KubeError(f"{what}: {exc}", status=exc.status) from exc
        session = await self._session_for(identity)
        headers = request_headers(authorization, content_type=None if body is None else content_type)
        try:
            async with session.request(
                method,
                self.host + path,
                data=None if body is None else jsonio.dumps(body),
                headers=headers,
                **(
                    self._options
                    if timeout is None
                    else {**self._options, "timeout": aiohttp.ClientTimeout(total=timeout)}
                ),
            ) as response:
                data = await response.read()
                status, reason = response.status, response.reason
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeError(f"{what}: API server unreachable ({type(exc).__name__}: {exc})") from exc
        if status == 401:
            credential.refused(authorization)  # the next call presents a fresh one, if there is one
        if status >= 300:
            raise error_for(f"{what}: {status} {status_message(data, reason)}", status)
        return jsonio.loads(data or b"null")

    async def _session_for(self, identity: Identity | None) -> aiohttp.ClientSession:
        """One pool while the client certificate stays (an exec plugin's may be replaced)."""
        if self._session is None or identity is not self._identity:
            if self._session is not None:
                await self._session.close()
            tls: ssl.SSLContext | bool = self.credentials.ssl_context(identity) if self.credentials.https else True
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connections, ssl=tls),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
            )
            self._identity = identity
        return self._session
