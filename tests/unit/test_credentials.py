"""Reading kubeconfigs and service accounts the way kubectl reads them (``gpushared.kube.credentials``)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpushared.kube import credentials as creds
from gpushared.kube import kubeconfig as kubeconfigs
from gpushared.kube.errors import KubeError, NoCredentials

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kubeconfig(user: dict[str, Any], cluster: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://api.example:6443"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [
            {"name": "x", "context": {"cluster": "c", "user": "u"}},
            {"name": "y", "context": {"cluster": "c"}},
        ],
        "current-context": "x",
    }
    doc.update(top)
    return doc


def load(doc: Any, tmp_path: Path, *, context: str | None = None, **environ: str) -> creds.Credentials:
    return kubeconfigs.from_kubeconfig(doc, base=tmp_path, context=context, source="kubeconfig k", environ=environ)


# --- what each kind of kubeconfig user presents ------------------------------------------------------------

CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("a token", {"token": "t0k"}, "Bearer t0k"),
    (
        "an oidc auth-provider's id-token",
        {"auth-provider": {"name": "oidc", "config": {"id-token": "idt"}}},
        "Bearer idt",
    ),
    ("a username and password", {"username": "admin", "password": "pw"}, "Basic " + b64("admin:pw")),
    ("nothing: anonymous", {}, None),
    ("a client certificate only", {"client-certificate-data": b64("C"), "client-key-data": b64("K")}, None),
]


@pytest.mark.parametrize(("case", "user", "authorization"), CASES, ids=[c[0] for c in CASES])
def test_each_kind_of_user_presents_what_kubectl_would(
    tmp_path: Path, case: str, user: dict[str, Any], authorization: str | None
) -> None:
    loaded = load(kubeconfig(user), tmp_path)
    assert loaded.server == "https://api.example:6443"
    assert loaded.credential.authorization() == authorization


def test_the_cluster_settings_and_relative_paths_are_the_kubeconfigs(tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "client.crt").write_text("CERT")
    (tmp_path / "pki" / "client.key").write_text("KEY")
    cluster = {
        "server": "https://10.0.0.1:6443/",
        "certificate-authority": "pki/ca.crt",
        "tls-server-name": "kubernetes.default",
        "proxy-url": "http://proxy:3128",
    }
    user = {"client-certificate": "pki/client.crt", "client-key": "pki/client.key", "token": "t"}
    loaded = load(kubeconfig(user, cluster), tmp_path)
    assert loaded.server == "https://10.0.0.1:6443"
    assert loaded.ca_file == str(tmp_path / "pki" / "ca.crt")
    assert (loaded.tls_server_name, loaded.proxy, loaded.verify) == ("kubernetes.default", "http://proxy:3128", True)
    assert loaded.credential.identity() == creds.Identity(b"CERT", b"KEY")
    assert loaded.credential.authorization() == "Bearer t"  # both: the certificate for TLS, the token per request

    inline = load(kubeconfig({}, {"server": "https://a:1", "certificate-authority-data": b64(CA)}), tmp_path)
    assert (inline.ca_data, inline.ca_file) == (CA, None)
    insecure = load(kubeconfig({}, {"server": "https://a:1", "insecure-skip-tls-verify": True}), tmp_path)
    assert insecure.verify is False


def test_a_named_context_is_taken_over_the_current_one(tmp_path: Path) -> None:
    assert load(kubeconfig({"token": "t"}), tmp_path, context="y").credential.authorization() is None
    assert load(kubeconfig({"token": "t"}), tmp_path).credential.authorization() == "Bearer t"


BROKEN: list[tuple[str, Any, str]] = [
    ("not a mapping", ["a"], "not a kubeconfig"),
    ("no current context", kubeconfig({}, **{"current-context": ""}), "no current-context"),
    ("an unknown context", kubeconfig({}, **{"current-context": "z"}), "no context named 'z'"),
    ("an unknown cluster", {**kubeconfig({}), "clusters": []}, "no cluster named 'c'"),
    ("a server that is no URL", kubeconfig({}, {"server": "api:6443"}), "server 'api:6443' is not an http(s) URL"),
    ("bad base64", kubeconfig({"client-certificate-data": "%%", "client-key-data": "a"}), "is not base64"),
    ("a certificate without its key", kubeconfig({"client-certificate-data": b64("C")}), "without its key"),
    ("a missing key file", kubeconfig({"client-certificate-data": b64("C"), "client-key": "no.key"}), "client-key"),
    ("the gcp auth-provider", kubeconfig({"auth-provider": {"name": "gcp"}}), "auth-provider gcp is not supported"),
    (
        "exec v1 without interactiveMode",
        kubeconfig({"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "x"}}),
        "without interactiveMode",
    ),
    (
        "exec of an unknown apiVersion",
        kubeconfig({"exec": {"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"}}),
        "apiVersion 'client.authentication.k8s.io/v1alpha1'",
    ),
]


@pytest.mark.parametrize(("case", "doc", "message"), BROKEN, ids=[c[0] for c in BROKEN])
def test_a_broken_kubeconfig_names_the_file_and_what_is_wrong(
    tmp_path: Path, case: str, doc: Any, message: str
) -> None:
    with pytest.raises(KubeError, match=r"^kubeconfig k: ") as broken:
        load(doc, tmp_path)
    assert message in str(broken.value)


def test_load_reads_the_file_else_the_service_account_else_says_there_is_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig({"token": "t"})))
    assert kubeconfigs.load(path).source == f"kubeconfig {path}"
    path.write_text("clusters: [")
    with pytest.raises(KubeError, match=f"^kubeconfig {path}: "):
        kubeconfigs.load(path)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(NoCredentials):
        kubeconfigs.load(tmp_path / "absent")


# --- what changes while we run: token files, exec plugins -------------------------------------------------


def test_a_token_file_is_read_again_once_a_second(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("one\n")
    now = [100.0]
    credential = creds.TokenFile(token, clock=lambda: now[0])
    assert credential.authorization() == "Bearer one"
    token.write_text("two")
    assert credential.authorization() == "Bearer one"  # within the second: not read
    now[0] += creds.REFRESH_SECONDS
    assert credential.authorization() == "Bearer two"
    token.write_text("three")
    assert credential.refused("Bearer two") is True  # a 401: read now, and a new token is worth a retry
    assert credential.authorization() == "Bearer three"
    token.unlink()
    now[0] += creds.REFRESH_SECONDS
    assert credential.authorization() == "Bearer three"  # gone for a moment (replaced): keep the last
    with pytest.raises(KubeError, match="token file"):
        creds.TokenFile(token).authorization()


def test_in_cluster_takes_the_service_and_the_mounted_token(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_text(CA)
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443", "NO_PROXY": "fd00::/64"}
    loaded = kubeconfigs.in_cluster({**env, "HTTPS_PROXY": "http://proxy:3128"}, root=tmp_path)
    assert loaded.server == "https://[fd00::1]:443"
    assert (loaded.ca_file, loaded.proxy) == (str(tmp_path / "ca.crt"), None)
    assert loaded.credential.authorization() == "Bearer sa-token"
    (tmp_path / "token").unlink()
    with pytest.raises(KubeError, match="automountServiceAccountToken"):
        kubeconfigs.in_cluster(env, root=tmp_path)
    with pytest.raises(KubeError, match="KUBERNETES_SERVICE_PORT"):
        kubeconfigs.in_cluster({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, root=tmp_path)


PROXIES = [
    ({"HTTPS_PROXY": "http://p:3128"}, "http://p:3128"),
    ({"https_proxy": "http://p:3128", "no_proxy": "example"}, None),  # a domain suffix
    ({"HTTPS_PROXY": "http://p:3128", "NO_PROXY": ".example"}, None),
    ({"HTTPS_PROXY": "http://p:3128", "NO_PROXY": "api.example:6443"}, None),
    ({"HTTPS_PROXY": "http://p:3128", "NO_PROXY": "api.example:443"}, "http://p:3128"),  # another port
    ({"HTTPS_PROXY": "http://p:3128", "NO_PROXY": "xample"}, "http://p:3128"),  # not a suffix at a dot
    ({"HTTPS_PROXY": "http://p:3128", "NO_PROXY": "*"}, None),
    ({"HTTP_PROXY": "http://p:3128"}, None),  # the https server's scheme decides
]


@pytest.mark.parametrize(("environ", "proxy"), PROXIES)
def test_proxies_come_from_the_environment_unless_no_proxy_names_the_server(
    tmp_path: Path, environ: dict[str, str], proxy: str | None
) -> None:
    assert load(kubeconfig({}), tmp_path, **environ).proxy == proxy


def test_no_proxy_matches_addresses_by_cidr(tmp_path: Path) -> None:
    doc = kubeconfig({}, {"server": "https://10.96.0.1:443"})
    assert load(doc, tmp_path, HTTPS_PROXY="http://p:1", NO_PROXY="10.96.0.0/12").proxy is None
    assert load(doc, tmp_path, HTTPS_PROXY="http://p:1", NO_PROXY="10.0.0.0/16").proxy == "http://p:1"
