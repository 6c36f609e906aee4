"""The extender's bind calls on its event loop: reading a pod and creating its Binding, with aiohttp.

kube-scheduler binds pods while it filters the next ones, so the extender's binds are its hot path. Through
the generated client each call takes a worker thread, urllib3 and the client's own serialisation (what that
cost: docs/benchmarks.md, "Figures behind the code"); here it is one coroutine on the loop. The credentials
are the kubernetes client's, read from the same ``Configuration`` (certificates, CA, token and its refresh
hook, proxy), so the two clients authenticate the same way.
"""

from __future__ import annotations

import ssl
from typing import Any, cast
from urllib.parse import quote, urlsplit

import aiohttp
import kubernetes
import orjson
from kubernetes.client.rest import should_bypass_proxies

from gpushared.core.bodies import PodBody
from gpushared.kube.api import REQUEST_TIMEOUT, KubeError, error_for, status_message


class AsyncApi:
    """Pods read and bound over one pool of keep-alive connections; open it on the loop that uses it."""

    def __init__(self, configuration: kubernetes.client.Configuration, *, connections: int = 32) -> None:
        self.configuration = configuration
        self.host = configuration.host.rstrip("/")
        self.connections = connections
        self.proxy: str | None = None
        if configuration.proxy and not should_bypass_proxies(self.host, configuration.no_proxy or ""):
            if urlsplit(configuration.proxy).scheme != "http":
                raise KubeError(
                    f"proxy {configuration.proxy}: the extender reaches the API server through http:// proxies only"
                )
            self.proxy = configuration.proxy
        self._ssl: ssl.SSLContext | bool = _ssl_context(configuration) if self.host.startswith("https:") else True
        #: what every request passes beside its own arguments: the proxy, and the name the TLS server must have
        self._options: dict[str, Any] = {"proxy": self.proxy}
        if configuration.tls_server_name:
            self._options["server_hostname"] = configuration.tls_server_name
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_pod(self, namespace: str, name: str) -> PodBody:
        return cast(PodBody, await self._call(f"get pod {namespace}/{name}", "GET", _pod_path(namespace, name)))

    async def bind_pod(self, namespace: str, name: str, *, uid: str, node: str, annotations: dict[str, str]) -> None:
        """Create the pod's Binding; the UID makes it fail if the pod was deleted and re-created meanwhile.
        kube-apiserver copies the Binding's annotations onto the pod in the write that sets its node."""
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "annotations": annotations},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self._call(
            f"bind pod {namespace}/{name} to {node}",
            "POST",
            _pod_path(namespace, name) + "/binding",
            binding,
        )

    async def _call(self, what: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connections, ssl=self._ssl),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
            )
        headers = {"Accept": "application/json", "User-Agent": "gpushared-extender"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        # The client's own rule: its credentials hook runs before every request (it is throttled by connect()).
        token = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if token:
            headers["Authorization"] = token
        try:
            async with self._session.request(
                method,
                self.host + path,
                data=None if body is None else orjson.dumps(body),
                headers=headers,
                **self._options,
            ) as response:
                data = await response.read()
                status, reason = response.status, response.reason
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeError(f"{what}: API server unreachable ({type(exc).__name__}: {exc})") from exc
        if status >= 300:
            raise error_for(f"{what}: {status} {status_message(data, reason)}", status)
        return orjson.loads(data or b"null")


def _pod_path(namespace: str, name: str) -> str:
    """Quoted whatever the caller checked: a name with '/', '..' or '?' must never reach another path."""
    if {namespace, name} & {"", ".", ".."}:
        raise KubeError(f"pod {namespace!r}/{name!r}: not a name an API path can carry", status=400)
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"


def _ssl_context(configuration: kubernetes.client.Configuration) -> ssl.SSLContext:
    """What the kubernetes client gives urllib3: the CA (file or data), the client certificate, and
    whether to verify the server and its name."""
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert, cadata=configuration.ca_cert_data)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif configuration.assert_hostname is False:
        context.check_hostname = False
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context
