"""gpushared's HTTP client for the API server (``gpushared.kube.rest``): TLS both ways, credentials that
change, and the errors a caller sees."""

from __future__ import annotations

import base64
import http.server
import json
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushared.kube.api import Api
from gpushared.kube.credentials import Credential, Credentials, StaticCredential
from gpushared.kube.errors import KubeError, NotFound
from gpushared.kube.kubeconfig import from_kubeconfig
from gpushared.kube.rest import Rest
from tests.builders import pod
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a serving certificate for 127.0.0.1 and gpushared-extender.kube-system.svc, and a client
    certificate (CN system:kube-scheduler), as scripts/extender-certs makes them."""
    folder = tmp_path_factory.mktemp("pki")
    subprocess.run([ROOT / "scripts" / "extender-certs", folder], check=True, capture_output=True)
    return folder


@pytest.fixture
def tls_server(pki: Path) -> Iterator[str]:
    """An HTTPS server that wants a client certificate from the CA and answers with its common name."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            peer = self.connection.getpeercert() or {}  # type: ignore[attr-defined]
            subject = dict(pair for rdn in peer.get("subject", ()) for pair in rdn)
            body = json.dumps({"client": subject.get("commonName"), "auth": self.headers.get("Authorization")})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.crt"))
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(str(pki / "extender.crt"), str(pki / "extender.key"))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(server: str, cluster: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    return {
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }


def test_tls_with_the_kubeconfigs_ca_client_certificate_and_server_name(tls_server: str, pki: Path) -> None:
    user = {"client-certificate-data": b64(pki / "scheduler.crt"), "client-key-data": b64(pki / "scheduler.key")}
    ca = {"certificate-authority-data": b64(pki / "ca.crt")}
    doc = kubeconfig(f"https://127.0.0.1:{tls_server}", ca, {**user, "token": "t"})
    answer = Rest(from_kubeconfig(doc, base=pki)).request("probe", "GET", "/")
    assert answer == {"client": "system:kube-scheduler", "auth": "Bearer t"}

    # "localhost" is not in the certificate: refused, unless tls-server-name names one that is
    by_name = kubeconfig(f"https://localhost:{tls_server}", ca, user)
    with pytest.raises(KubeError, match=r"^probe: API server unreachable .*certificate"):
        Rest(from_kubeconfig(by_name, base=pki), retries=False).request("probe", "GET", "/")
    named = {**ca, "tls-server-name": "gpushared-extender.kube-system.svc"}
    doc = kubeconfig(f"https://localhost:{tls_server}", named, user)
    assert Rest(from_kubeconfig(doc, base=pki)).request("probe", "GET", "/")["client"] == "system:kube-scheduler"

    # a CA file relative to the kubeconfig, and the system's CAs when none is named (which do not know ours)
    doc = kubeconfig(f"https://127.0.0.1:{tls_server}", {"certificate-authority": "ca.crt"}, user)
    assert Rest(from_kubeconfig(doc, base=pki)).request("probe", "GET", "/")["auth"] is None
    system = Rest(from_kubeconfig(kubeconfig(f"https://127.0.0.1:{tls_server}", {}, user), base=pki), retries=False)
    with pytest.raises(KubeError, match="unreachable"):
        system.request("probe", "GET", "/")
    insecure = kubeconfig(f"https://127.0.0.1:{tls_server}", {"insecure-skip-tls-verify": True}, user)
    assert Rest(from_kubeconfig(insecure, base=pki)).request("probe", "GET", "/")["client"] == "system:kube-scheduler"


def test_a_server_that_wants_a_client_certificate_refuses_a_call_without_one(tls_server: str, pki: Path) -> None:
    doc = kubeconfig(f"https://127.0.0.1:{tls_server}", {"certificate-authority-data": b64(pki / "ca.crt")}, {})
    with pytest.raises(KubeError, match="unreachable"):
        Rest(from_kubeconfig(doc, base=pki), retries=False).request("probe", "GET", "/")


class Rotating(Credential):
    """A token that changes when refused, as a rotated service-account token or an exec plugin's does."""

    def __init__(self) -> None:
        self.token = "old"
        self.refusals = 0

    def authorization(self) -> str | None:
        return f"Bearer {self.token}"

    def refused(self, authorization: str | None) -> bool:
        self.refusals += 1
        self.token = "new"
        return authorization != self.authorization()


def test_a_401_is_tried_once_more_with_a_fresh_credential() -> None:
    with FakeApiServer() as server:
        server.create(pod("p", 4))
        rotating = Rotating()
        api = Api(Rest(Credentials(server=server.url, credential=rotating)))
        server.inject(Fault(method="GET", path="/pods/p$", status=401, message="Unauthorized"))
        assert api.get_pod("default", "p")["metadata"]["name"] == "p"
        assert [r.authorization for r in server.requests if r.path.endswith("/pods/p")] == ["Bearer old", "Bearer new"]
        server.inject(Fault(method="GET", path="/pods/p$", status=401, message="Unauthorized", times=2))
        with pytest.raises(KubeError, match=r"^get pod default/p: 401 Unauthorized$") as refused:
            api.get_pod("default", "p")  # refused again with the fresh one: an error, not a loop
        assert refused.value.status == 401
        assert rotating.refusals == 2


def test_errors_name_the_call_and_carry_the_status() -> None:
    with FakeApiServer() as server:
        api = Api(server.rest(token="t"))
        with pytest.raises(NotFound, match=r'^get pod default/nope: 404 pods "nope" not found$'):
            api.get_pod("default", "nope")
        with pytest.raises(KubeError, match="not a name an API path can carry") as bad:
            api.get_pod("default", "..")
        assert bad.value.status == 400
        server.inject(Fault(method="PATCH", path="/pods/", status=500, message="etcd hiccup"))
        server.create(pod("p", 4))
        with pytest.raises(KubeError, match=r"^patch pod default/p: 500 etcd hiccup$"):
            api.patch_pod("default", "p", {"metadata": {"labels": {"a": "b"}}})
        patched = api.patch_pod("default", "p", {"metadata": {"labels": {"a": "b"}}})  # strategic merge
        assert patched["metadata"]["labels"]["a"] == "b"
        assert patched["spec"]["containers"]
    unreachable = Api(Rest(Credentials(server=f"http://127.0.0.1:{free_port()}"), retries=False))
    with pytest.raises(KubeError, match=r"^list nodes: API server unreachable \(") as cut:
        unreachable.list_nodes()
    assert cut.value.status is None


def test_a_credential_that_cannot_be_had_is_the_calls_error() -> None:
    class Broken(StaticCredential):
        def authorization(self) -> str | None:
            raise KubeError("exec plugin x: exit status 1: login first")

    api = Api(Rest(Credentials(server="http://127.0.0.1:1", credential=Broken())))
    with pytest.raises(KubeError, match=r"^list nodes: exec plugin x: exit status 1: login first$"):
        api.list_nodes()


def test_an_answer_that_is_not_json_is_an_error_not_a_crash() -> None:
    """A proxy's HTML page where the API server should be: a KubeError naming the call."""

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>captive portal</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = Api(Rest(Credentials(server=f"http://127.0.0.1:{server.server_address[1]}")))
        with pytest.raises(KubeError, match=r"^list nodes: the API server answered something that is not JSON$"):
            api.list_nodes()
    finally:
        server.shutdown()
        server.server_close()
