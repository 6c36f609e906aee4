"""Where the API server is and how to prove who we are: a kubeconfig, or a pod's service account.

This is what the kubernetes Python client's loaders did for us, read the way kubectl (client-go) reads it,
so that a node, a control plane or a laptop that works with kubectl works here. We read it ourselves because
that client imports every API group's models: 30 MiB of a daemon that makes five kinds of call.

Read once (:func:`load`), except what is meant to change while we run: a token file is read again
(a service account's token rotates), and an exec plugin's credential is fetched again when it expires or
the API server refuses it (managed control planes hand out short-lived tokens).
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushared.kube import jsonio
from gpushared.kube.errors import KubeError

log = logging.getLogger(__name__)

#: How often a token file is read again: a rotated service-account token is taken within a second.
REFRESH_SECONDS = 1.0
#: An exec plugin's credential is fetched again this long before it expires, not after a refused call.
EXEC_EARLY_SECONDS = 10.0
#: How long an exec plugin may take (a cloud CLI fetching a token over the network).
EXEC_TIMEOUT_SECONDS = 60.0
EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")


@dataclass(frozen=True)
class Identity:
    """A client certificate and its key, PEM."""

    cert: bytes
    key: bytes


class Credential:
    """What authenticates each request: a bearer token, a client certificate, or both; nothing by default."""

    def authorization(self) -> str | None:
        """The ``Authorization`` header for the next request."""
        return None

    def identity(self) -> Identity | None:
        """The client certificate for the next connection; a new object means new connections."""
        return None

    def refused(self, authorization: str | None) -> bool:
        """The API server answered 401 to ``authorization``: True when there is a new one worth a retry."""
        return False


@dataclass
class StaticCredential(Credential):
    token: str | None = None
    cert: Identity | None = None
    basic: tuple[str, str] | None = None

    def authorization(self) -> str | None:
        if self.token:
            return f"Bearer {self.token}"
        if self.basic:
            return "Basic " + base64.b64encode(f"{self.basic[0]}:{self.basic[1]}".encode()).decode()
        return None

    def identity(self) -> Identity | None:
        return self.cert


@dataclass
class TokenFile(Credential):
    """A token read from a file, again at most every REFRESH_SECONDS: projected service-account tokens
    rotate (hourly by default), and the kubelet replaces the file in place."""

    path: Path
    cert: Identity | None = None
    clock: Callable[[], float] = time.monotonic
    _token: str = ""
    _read_at: float = field(default=-1e18)

    def authorization(self) -> str | None:
        now = self.clock()
        if now - self._read_at >= REFRESH_SECONDS:
            self._read_at = now
            try:
                self._token = self.path.read_text().strip()
            except OSError as exc:
                if not self._token:
                    raise KubeError(f"token file {self.path}: {exc.strerror}") from None
                log.warning("token file %s: %s; using the token read before", self.path, exc.strerror)
        return f"Bearer {self._token}" if self._token else None

    def identity(self) -> Identity | None:
        return self.cert

    def refused(self, authorization: str | None) -> bool:
        self._read_at = -1e18  # read it again now: it may just have rotated
        return self.authorization() != authorization


@dataclass(frozen=True)
class ExecPlugin:
    """A kubeconfig user's ``exec`` stanza (client.authentication.k8s.io): a command that prints an
    ExecCredential, as cloud providers' CLIs do (aws eks get-token, gke-gcloud-auth-plugin, kubelogin)."""

    command: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    api_version: str
    interactive: str  # Never, IfAvailable, Always
    install_hint: str
    cluster: Mapping[str, Any] | None  # given to the plugin when provideClusterInfo is set


@dataclass
class ExecCredential(Credential):
    """The credential an exec plugin prints, fetched when first needed, again before it expires, and again
    when the API server refuses it (client-go's rules)."""

    plugin: ExecPlugin
    cert: Identity | None = None  # the kubeconfig's own, used unless the plugin gives one
    clock: Callable[[], float] = time.time
    run: Callable[..., subprocess.CompletedProcess[bytes]] = subprocess.run
    _token: str | None = None
    _identity: Identity | None = None
    _expires: float | None = None
    _fetched: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def authorization(self) -> str | None:
        self._fresh()
        return f"Bearer {self._token}" if self._token else None

    def identity(self) -> Identity | None:
        self._fresh()
        return self._identity or self.cert

    def refused(self, authorization: str | None) -> bool:
        with self._lock:
            current = f"Bearer {self._token}" if self._token else None
            if current == authorization:  # nobody fetched a new one meanwhile
                self._fetched = False
        return self.authorization() != authorization

    def _fresh(self) -> None:
        with self._lock:
            expired = self._expires is not None and self.clock() >= self._expires - EXEC_EARLY_SECONDS
            if self._fetched and not expired:
                return
            self._token, self._identity, self._expires = self._fetch()
            self._fetched = True

    def _fetch(self) -> tuple[str | None, Identity | None, float | None]:
        plugin = self.plugin
        interactive = plugin.interactive != "Never" and sys.stdin is not None and sys.stdin.isatty()
        if plugin.interactive == "Always" and not interactive:
            raise KubeError(f"exec plugin {plugin.command}: needs a terminal (interactiveMode: Always)")
        spec: dict[str, Any] = {"interactive": interactive}
        if plugin.cluster is not None:
            spec["cluster"] = dict(plugin.cluster)
        info = {"apiVersion": plugin.api_version, "kind": "ExecCredential", "spec": spec}
        env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": jsonio.dumps(info).decode()}
        what = f"exec plugin {plugin.command}"
        try:
            done = self.run(
                [plugin.command, *plugin.args],
                env=env,
                stdin=None if interactive else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=None if interactive else subprocess.PIPE,
                timeout=EXEC_TIMEOUT_SECONDS,
                check=False,
            )
        except FileNotFoundError:
            hint = f" ({plugin.install_hint.strip()})" if plugin.install_hint.strip() else ""
            raise KubeError(f"{what}: not found{hint}") from None
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KubeError(f"{what}: {exc}") from None
        if done.returncode != 0:
            said = (done.stderr or b"").decode(errors="replace").strip().splitlines()
            raise KubeError(f"{what}: exit status {done.returncode}" + (f": {said[-1]}" if said else ""))
        return parse_exec_credential(done.stdout, api_version=plugin.api_version, what=what)


def parse_exec_credential(
    out: bytes, *, api_version: str, what: str
) -> tuple[str | None, Identity | None, float | None]:
    """The token, client certificate and expiry (epoch seconds) an exec plugin printed."""
    try:
        body = jsonio.loads(out)
    except jsonio.JSONDecodeError as exc:
        raise KubeError(f"{what}: printed no ExecCredential JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("kind") != "ExecCredential":
        raise KubeError(f"{what}: printed no ExecCredential")
    if body.get("apiVersion") != api_version:
        raise KubeError(f"{what}: printed apiVersion {body.get('apiVersion')!r}, the kubeconfig asks {api_version}")
    status = body.get("status")
    if not isinstance(status, dict):
        raise KubeError(f"{what}: the ExecCredential has no status")
    token = status.get("token") or None
    cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
    if bool(cert) != bool(key):
        raise KubeError(f"{what}: the ExecCredential has a client certificate without its key, or a key alone")
    if not token and not cert:
        raise KubeError(f"{what}: the ExecCredential has neither a token nor a client certificate")
    expires: float | None = None
    stamp = status.get("expirationTimestamp")
    if stamp:
        try:
            expires = datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise KubeError(f"{what}: expirationTimestamp {stamp!r} is not RFC 3339") from None
    identity = Identity(str(cert).encode(), str(key).encode()) if cert else None
    return (str(token) if token else None), identity, expires


@dataclass
class Credentials:
    """An API server's address, how to trust it, and the credential to present."""

    server: str
    credential: Credential = field(default_factory=Credential)
    ca_file: str | None = None
    ca_data: str | None = None  # PEM
    verify: bool = True
    tls_server_name: str | None = None
    proxy: str | None = None
    #: where these came from, for messages
    source: str = ""

    @property
    def https(self) -> bool:
        return self.server.startswith("https:")

    def ssl_context(self, identity: Identity | None) -> ssl.SSLContext:
        """The CA given (else the system's), whether to verify, and the client certificate."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file, cadata=self.ca_data)
        except (OSError, ssl.SSLError) as exc:
            raise KubeError(f"{self.source}: the certificate authority does not load ({exc})") from None
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if identity is not None:
            _load_identity(context, identity, self.source)
        return context


def _load_identity(context: ssl.SSLContext, identity: Identity, source: str) -> None:
    """``ssl`` loads a certificate only from files: they live for the call, in a directory only we read."""
    with tempfile.TemporaryDirectory(prefix="gpushared-") as folder:
        cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert.write_bytes(identity.cert)
        key.write_bytes(identity.key)
        try:
            context.load_cert_chain(str(cert), str(key))
        except ssl.SSLError as exc:
            raise KubeError(f"{source}: the client certificate and key do not load ({exc})") from None
