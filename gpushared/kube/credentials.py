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
import binascii
import datetime
import ipaddress
import logging
import os
import shutil
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
from urllib.parse import urlsplit

import orjson
import yaml

from gpushared.kube.errors import KubeError, NoCredentials

log = logging.getLogger(__name__)

#: How often a token file is read again: a rotated service-account token is taken within a second.
REFRESH_SECONDS = 1.0
#: An exec plugin's credential is fetched again this long before it expires, not after a refused call.
EXEC_EARLY_SECONDS = 10.0
#: How long an exec plugin may take (a cloud CLI fetching a token over the network).
EXEC_TIMEOUT_SECONDS = 60.0
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
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
        env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": orjson.dumps(info).decode()}
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
        body = orjson.loads(out)
    except orjson.JSONDecodeError as exc:
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


def load(kubeconfig: Path | None, *, context: str | None = None) -> Credentials:
    """``kubeconfig`` when that file exists, else the pod's service account."""
    if kubeconfig is not None and kubeconfig.exists():
        try:
            doc = yaml.safe_load(kubeconfig.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise KubeError(f"kubeconfig {kubeconfig}: {exc}") from None
        return from_kubeconfig(doc, base=kubeconfig.parent, context=context, source=f"kubeconfig {kubeconfig}")
    if "KUBERNETES_SERVICE_HOST" in os.environ:
        return in_cluster(os.environ)
    raise NoCredentials(f"no kubeconfig at {kubeconfig} and not running in a pod: cannot reach the API server")


def in_cluster(environ: Mapping[str, str], *, root: Path = SERVICE_ACCOUNT) -> Credentials:
    """A pod's view: the API server's Service from the environment, the mounted token and CA."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST", ""), environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeError("in a pod without KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT")
    token = root / "token"
    if not token.exists():
        raise KubeError(f"in a pod without a service-account token at {token} (automountServiceAccountToken?)")
    ca = root / "ca.crt"
    server = f"https://{f'[{host}]' if ':' in host else host}:{port}"
    return Credentials(
        server=server,
        credential=TokenFile(token),
        ca_file=str(ca) if ca.exists() else None,
        proxy=_environment_proxy(server, environ),
        source="the pod's service account",
    )


def from_kubeconfig(
    doc: Any,
    *,
    base: Path,
    context: str | None = None,
    source: str = "kubeconfig",
    environ: Mapping[str, str] | None = None,
) -> Credentials:
    """The credentials of ``context`` (else the current context) in a parsed kubeconfig. Relative paths in
    it are relative to ``base``, the kubeconfig's folder, as kubectl reads them."""
    environ = os.environ if environ is None else environ

    def fail(reason: str) -> KubeError:
        return KubeError(f"{source}: {reason}")

    if not isinstance(doc, dict):
        raise fail("not a kubeconfig (no mapping at the top)")
    name = context or doc.get("current-context")
    if not name:
        raise fail("no current-context, and no context named")
    ctx = _named(doc, "contexts", str(name), "context", fail)
    cluster = _named(doc, "clusters", str(ctx.get("cluster") or ""), "cluster", fail)
    user = _named(doc, "users", str(ctx["user"]), "user", fail) if ctx.get("user") else {}
    server = str(cluster.get("server") or "")
    if urlsplit(server).scheme not in ("http", "https") or not urlsplit(server).hostname:
        raise fail(f"cluster {ctx.get('cluster')}: server {server!r} is not an http(s) URL")

    def path(key: str, where: Mapping[str, Any]) -> str | None:
        value = where.get(key)
        return str(base / str(value)) if value else None

    def data(key: str, where: Mapping[str, Any]) -> bytes | None:
        value = where.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError):
            raise fail(f"{key} is not base64") from None

    def pem(data_key: str, file_key: str, where: Mapping[str, Any]) -> bytes | None:
        inline = data(data_key, where)
        if inline is not None:
            return inline
        file = path(file_key, where)
        if file is None:
            return None
        try:
            return Path(file).read_bytes()
        except OSError as exc:
            raise fail(f"{file_key} {file}: {exc.strerror}") from None

    ca_data = data("certificate-authority-data", cluster)
    credentials = Credentials(
        server=server.rstrip("/"),
        ca_file=None if ca_data else path("certificate-authority", cluster),
        ca_data=ca_data.decode() if ca_data else None,
        verify=not cluster.get("insecure-skip-tls-verify", False),
        tls_server_name=cluster.get("tls-server-name") or None,
        proxy=cluster.get("proxy-url") or _environment_proxy(server, environ),
        source=source,
    )
    cert, key = pem("client-certificate-data", "client-certificate", user), pem("client-key-data", "client-key", user)
    if bool(cert) != bool(key):
        raise fail(f"user {ctx.get('user')}: a client certificate without its key, or a key alone")
    identity = Identity(cert, key) if cert and key else None
    credentials.credential = _credential(user, identity, base=base, cluster=cluster, server=server, fail=fail)
    return credentials


def _credential(
    user: Mapping[str, Any],
    identity: Identity | None,
    *,
    base: Path,
    cluster: Mapping[str, Any],
    server: str,
    fail: Callable[[str], KubeError],
) -> Credential:
    """client-go's order: a token file over a token; an exec plugin; a username and password."""
    if user.get("tokenFile"):
        return TokenFile(base / str(user["tokenFile"]), cert=identity)
    if user.get("token"):
        return StaticCredential(token=str(user["token"]), cert=identity)
    if isinstance(user.get("exec"), dict):
        return ExecCredential(
            _exec_plugin(user["exec"], base=base, cluster=cluster, server=server, fail=fail), identity
        )
    provider = user.get("auth-provider")
    if isinstance(provider, dict):
        name = provider.get("name")
        token = (provider.get("config") or {}).get("id-token")
        if name == "oidc" and token:
            return StaticCredential(token=str(token), cert=identity)  # not refreshed: kubectl's oidc-login does
        raise fail(
            f"auth-provider {name} is not supported (client-go dropped gcp and azure in 1.26): "
            "use the provider's exec plugin (gke-gcloud-auth-plugin, kubelogin)"
        )
    if user.get("username"):
        return StaticCredential(cert=identity, basic=(str(user["username"]), str(user.get("password") or "")))
    return StaticCredential(cert=identity)


def _exec_plugin(
    stanza: Mapping[str, Any],
    *,
    base: Path,
    cluster: Mapping[str, Any],
    server: str,
    fail: Callable[[str], KubeError],
) -> ExecPlugin:
    api_version = str(stanza.get("apiVersion") or "")
    if api_version not in EXEC_API_VERSIONS:
        raise fail(f"exec plugin apiVersion {api_version!r}: not one of {', '.join(EXEC_API_VERSIONS)}")
    command = str(stanza.get("command") or "")
    if not command:
        raise fail("exec plugin without a command")
    if os.sep in command and not os.path.isabs(command):
        command = str(base / command)  # client-go: a relative path is the kubeconfig's, a bare name PATH's
    elif os.sep not in command:
        command = shutil.which(command) or command
    env = tuple((str(e.get("name")), str(e.get("value") or "")) for e in stanza.get("env") or [] if isinstance(e, dict))
    info = None
    if stanza.get("provideClusterInfo"):
        info = {"server": server}
        # the Cluster of client.authentication.k8s.io names these fields as the kubeconfig does
        for key in ("certificate-authority-data", "insecure-skip-tls-verify", "tls-server-name", "proxy-url"):
            if cluster.get(key):
                info[key] = cluster[key]
        extension = next(
            (
                e.get("extension")
                for e in cluster.get("extensions") or []
                if e.get("name") == "client.authentication.k8s.io/exec"
            ),
            None,
        )
        if extension is not None:
            info["config"] = extension
    mode = str(stanza.get("interactiveMode") or "")
    if not mode:
        if api_version.endswith("/v1"):
            raise fail("exec plugin of client.authentication.k8s.io/v1 without interactiveMode (required there)")
        mode = "IfAvailable"  # v1beta1's default
    if mode not in ("Never", "IfAvailable", "Always"):
        raise fail(f"exec plugin interactiveMode {mode!r}: not Never, IfAvailable or Always")
    return ExecPlugin(
        command=command,
        args=tuple(str(a) for a in stanza.get("args") or []),
        env=env,
        api_version=api_version,
        interactive=mode,
        install_hint=str(stanza.get("installHint") or ""),
        cluster=info,
    )


def _named(
    doc: Mapping[str, Any], section: str, name: str, key: str, fail: Callable[[str], KubeError]
) -> dict[str, Any]:
    for entry in doc.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(key)
            return body if isinstance(body, dict) else {}
    raise fail(f"no {key} named {name!r}")


def _environment_proxy(server: str, environ: Mapping[str, str]) -> str | None:
    """HTTPS_PROXY / HTTP_PROXY unless NO_PROXY names the server, as client-go's ProxyFromEnvironment."""
    parts = urlsplit(server)
    proxies = {k.lower(): v for k, v in environ.items() if k.lower().endswith("_proxy") and v}
    proxy = proxies.get(f"{parts.scheme}_proxy")
    if not proxy:
        return None
    no_proxy = proxies.get("no_proxy", "")
    host = parts.hostname or ""
    if no_proxy == "*" or _bypassed(host, parts.port, no_proxy):
        return None
    return proxy


def _bypassed(host: str, port: int | None, no_proxy: str) -> bool:
    """NO_PROXY's entries: hosts and domain suffixes (``.example.com`` or ``example.com``), host:port,
    and CIDRs (client-go matches those; urllib's own rule does not)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip() for e in no_proxy.split(",")):
        if not entry:
            continue
        if address is not None and "/" in entry:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        name, _, entry_port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if entry_port and str(port) != entry_port:
            continue
        name = name.lstrip("*").lstrip(".").lower()
        if host.lower() == name or host.lower().endswith("." + name):
            return True
    return False
