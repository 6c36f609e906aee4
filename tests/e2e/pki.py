"""The local cluster's certificates and kubeconfigs: its own CA, kube-apiserver's serving certificate, the
extender's mutual TLS as ``scripts/extender-certs`` sets it up, the ServiceAccount signing key, and a
static token and kubeconfig per identity of ``USERS``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.e2e.layout import USERS


def make_pki(pki: Path, tokens: dict[str, str]) -> None:
    pki.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "30", "-subj", "/CN=gpushared-local-ca")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
            "-subj", "/CN=kube-apiserver")  # fmt: skip
    (pki / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\n"
    )
    openssl(
        "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "apiserver.crt", "-days", "30", "-extfile", "san.ext",
    )  # fmt: skip
    # The extender's mutual TLS, as scripts/extender-certs sets it up: its serving certificate (also its
    # client certificate when a follower forwards to the leader) and kube-scheduler's client certificate,
    # on P-256 keys (signed here by the cluster's RSA CA).
    for name, usage in (("extender", "serverAuth,clientAuth"), ("scheduler", "clientAuth")):
        common = "gpushared-extender" if name == "extender" else "system:kube-scheduler"
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={common}")  # fmt: skip
        (pki / f"{name}.ext").write_text(f"extendedKeyUsage={usage}\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "30", "-extfile", f"{name}.ext",
        )  # fmt: skip
    openssl("genrsa", "-out", "sa.key", "2048")
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
    lines = [f'{tokens[key]},{name},{key},"{group}"' for key, (name, group) in USERS.items()]
    (pki / "tokens.csv").write_text("\n".join(lines) + "\n")


def write_kubeconfig(path: Path, *, server: str, ca: Path, user: str, token: str) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "gpushared", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "gpushared", "context": {"cluster": "gpushared", "user": user}}],
        "current-context": "gpushared",
    }
    path.write_text(yaml.safe_dump(body))
    path.chmod(0o600)
