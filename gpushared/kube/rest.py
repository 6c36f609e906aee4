"""HTTP to the API server over one urllib3 pool: JSON in, JSON out, errors as :class:`KubeError`.

Every call has a timeout (a component must never hang on a slow API server). Idempotent calls are tried
again on a broken connection, three times as the kubernetes client did; :meth:`Rest.without_retries` gives
the same credentials tried once, for a caller with a deadline. A 401 asks the credential for a fresh one
(a rotated token, an expired exec credential) and tries once more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

from gpushared.kube import jsonio
from gpushared.kube.credentials import Credentials, Identity
from gpushared.kube.errors import KubeError, error_for, status_message

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0
USER_AGENT = "gpushared"

#: What an informer lists and watches with: query parameters and a timeout in, the open response out.
Lister = Callable[[Mapping[str, str], urllib3.Timeout], urllib3.BaseHTTPResponse]


class Rest:
    def __init__(self, credentials: Credentials, *, retries: bool = True, connections: int = 10) -> None:
        self.credentials = credentials
        self.retries = retries
        self.connections = connections
        self._lock = threading.Lock()
        self._identity: Identity | None = None
        self._pool: urllib3.PoolManager | None = None

    def without_retries(self) -> Rest:
        return Rest(self.credentials, retries=False, connections=self.connections)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.clear()

    # --- calls ----------------------------------------------------------------------------------------------

    def request(self, what: str, method: str, path: str, *, timeout: float = REQUEST_TIMEOUT, **call: Any) -> Any:
        """The parsed JSON the API server answered; a KubeError naming ``what`` otherwise. ``call``: the
        query, body and content type, as :meth:`open` takes them."""
        response = self.open(what, method, path, timeout=urllib3.Timeout(timeout), **call)
        try:
            data = response.data
        except Exception as exc:  # cut mid-body
            raise KubeError(f"{what}: API server unreachable ({type(exc).__name__}: {exc})") from exc
        finally:
            response.release_conn()
        try:
            return jsonio.loads(data or b"null")
        except jsonio.JSONDecodeError:
            raise KubeError(f"{what}: the API server answered something that is not JSON") from None

    def open(
        self,
        what: str,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: urllib3.Timeout,
    ) -> urllib3.BaseHTTPResponse:
        """The response, its body not yet read (a watch streams it); an error status is raised here."""
        url = self.credentials.server + path + (f"?{urlencode(query)}" if query else "")
        payload = None if body is None else jsonio.dumps(body)
        credential = self.credentials.credential
        for attempt in (1, 2):
            try:
                authorization = credential.authorization()
                headers = request_headers(authorization, content_type=None if payload is None else content_type)
                response = self._pool_for(credential.identity()).request(
                    method,
                    url,
                    body=payload,
                    headers=headers,
                    timeout=timeout,
                    retries=urllib3.Retry(3) if self.retries else False,
                    preload_content=False,
                    redirect=False,
                )
            except KubeError as exc:
                raise KubeError(f"{what}: {exc}", status=exc.status) from exc
            except Exception as exc:  # urllib3 and socket errors: the server was not reached
                raise KubeError(f"{what}: API server unreachable ({type(exc).__name__}: {exc})") from exc
            if response.status < 300:
                return response
            try:
                data = response.data
            except Exception:
                data = b""
            response.release_conn()
            if response.status == 401 and attempt == 1 and credential.refused(authorization):
                continue  # a fresh credential: once more
            raise error_for(f"{what}: {response.status} {status_message(data, response.reason)}", response.status)
        raise AssertionError("unreachable")

    def lister(self, path: str, *, what: str) -> Lister:
        """List (and watch) the collection at ``path``, for an informer."""

        def call(query: Mapping[str, str], timeout: urllib3.Timeout) -> urllib3.BaseHTTPResponse:
            return self.open(what, "GET", path, query=query, timeout=timeout)

        return call

    # --- connections ----------------------------------------------------------------------------------------

    def _pool_for(self, identity: Identity | None) -> urllib3.PoolManager:
        """One pool while the client certificate stays; a new certificate (an exec plugin's) gets a new one."""
        with self._lock:
            if self._pool is None or identity is not self._identity:
                if self._pool is not None:
                    self._pool.clear()
                self._pool = self._new_pool(identity)
                self._identity = identity
            return self._pool

    def _new_pool(self, identity: Identity | None) -> urllib3.PoolManager:
        creds = self.credentials
        options: dict[str, Any] = {"maxsize": self.connections, "block": False}
        if creds.https:
            options["ssl_context"] = creds.ssl_context(identity)
            if not creds.verify:
                options["cert_reqs"] = "CERT_NONE"
                # asked for in the kubeconfig: said once here, not by urllib3 on every request
                urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
                log.warning("%s: insecure-skip-tls-verify: the API server's certificate is not checked", creds.source)
            if creds.tls_server_name:
                options["server_hostname"] = creds.tls_server_name
        if creds.proxy:
            scheme = creds.proxy.split("://", 1)[0].lower()
            if scheme not in ("http", "https"):
                raise KubeError(f"proxy {creds.proxy}: only http:// and https:// proxies are supported")
            return urllib3.ProxyManager(creds.proxy, **options)
        return urllib3.PoolManager(**options)


def request_headers(authorization: str | None, *, content_type: str | None) -> dict[str, str]:
    """What every call to the API server sends (``content_type``: with a body)."""
    headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
    if content_type is not None:
        headers["Content-Type"] = content_type
    if authorization:
        headers["Authorization"] = authorization
    return headers


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quoted(namespace, 'pods', name)}"


def quoted(*parts: str) -> str:
    """Path segments, each quoted whatever the caller checked: a name with '/', '..' or '?' must never reach
    another path."""
    if {*parts} & {"", ".", ".."}:
        raise KubeError(f"{'/'.join(map(repr, parts))}: not a name an API path can carry", status=400)
    return "/".join(quote(part, safe="") for part in parts)
