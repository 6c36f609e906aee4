"""Where the API server is and which credential proves who we are, read the way kubectl (client-go) reads
it: a kubeconfig (its current or named context, exec plugins, proxies) or a pod's service account.

What each credential does while we run (a token file read again, an exec plugin's credential fetched again)
is ``credentials.py``'s; this module only finds them.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gpushared.kube.credentials import (
    EXEC_API_VERSIONS,
    Credential,
    Credentials,
    ExecCredential,
    ExecPlugin,
    Identity,
    StaticCredential,
    TokenFile,
)
from gpushared.kube.errors import KubeError, NoCredentials

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


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
