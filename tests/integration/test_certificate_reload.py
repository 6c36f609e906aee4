"""The extender serves renewed certificates without a restart (issue #42): its TLS files are swapped the
way the kubelet swaps a Secret volume (a new timestamped directory, then the ``..data`` symlink replaced
atomically), and the next connection gets the new serving certificate, a client certificate from the new
CA is let in and one from the old CA is not; a set that does not load is kept out while the last good one
serves; the expiry metric follows."""

from __future__ import annotations

import os
import shutil
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpushared.core.shared.x509 import not_after
from tests.builders import pod
from tests.extender_harness import Extender, gpushared_cluster
from tests.fakes.apiserver import FakeApiServer
from tests.harness import wait_until
from tests.pki import Authority, Pair


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        gpushared_cluster(server)
        yield server


class SecretVolume:
    """A directory laid out as the kubelet lays out a Secret volume, and its atomic update."""

    def __init__(self, root: Path) -> None:
        self.root, self.version = root, 0
        root.mkdir()

    def write(self, files: dict[str, Path]) -> None:
        self.version += 1
        data = self.root / f"..2026_11_26_{self.version}"
        data.mkdir()
        for name, source in files.items():
            shutil.copy(source, data / name)
        link = self.root / "..data_tmp"
        link.symlink_to(data.name)
        os.replace(link, self.root / "..data")  # the swap: readers see the old set or the new one
        for name in files:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")

    def path(self, name: str) -> Path:
        return self.root / name


def served(port: int) -> bytes:
    return ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", port), timeout=5))


def der(pair: Pair) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pair.cert.read_text())


def expiry_metric(ext: Extender, certificate: str) -> float | None:
    for line in ext.get("/metrics")[1].decode().splitlines():
        if line.startswith(f'gpushared_extender_certificate_expiry_seconds{{certificate="{certificate}"}}'):
            return float(line.split()[-1])
    return None


def test_renewed_certificates_are_served_without_a_restart(
    api: FakeApiServer, spawn: Callable[..., Extender], tmp_path: Path
) -> None:
    old, new = Authority(tmp_path / "old", "old-ca"), Authority(tmp_path / "new", "new-ca")
    old_server, new_server = (a.issue("extender", common_name="127.0.0.1", server=True) for a in (old, new))
    old_client, new_client = (a.issue("scheduler", common_name="system:kube-scheduler") for a in (old, new))
    volume = SecretVolume(tmp_path / "tls")
    volume.write({"tls.crt": old_server.cert, "tls.key": old_server.key, "ca.crt": old.cert})
    ext = spawn(
        api,
        ca=old.cert,
        client=(old_client.cert, old_client.key),
        args=[
            "--tls-cert", str(volume.path("tls.crt")),
            "--tls-key", str(volume.path("tls.key")),
            "--client-ca", str(volume.path("ca.crt")),
            "--client-name", "system:kube-scheduler",
            "--tls-reload-seconds", "0.2",
        ],
    )  # fmt: skip
    ext.wait_ready()
    body = api.create(pod("p", 4))
    assert ext.filter(body, "n1")[0] == 200
    assert served(ext.port) == der(old_server)
    assert expiry_metric(ext, "serving") == not_after(old_server.cert.read_bytes()).timestamp()

    volume.write({"tls.crt": new_server.cert, "tls.key": new_server.key, "ca.crt": new.cert})
    wait_until(lambda: served(ext.port) == der(new_server), timeout=10, message="the renewed certificate served")
    ext.ca, ext.client = new.cert, (new_client.cert, new_client.key)
    assert ext.filter(body, "n1")[0] == 200  # kube-scheduler with its renewed client certificate
    ext.client = (old_client.cert, old_client.key)
    assert ext.filter(body, "n1")[0] in (0, 401)  # the old CA is no longer trusted: handshake refused
    ext.client = None
    assert ext.filter(body, "n1")[0] == 401  # and no certificate at all is still no
    assert expiry_metric(ext, "serving") == not_after(new_server.cert.read_bytes()).timestamp()
    assert expiry_metric(ext, "client-ca") == not_after(new.cert.read_bytes()).timestamp()

    # A set that does not load (a certificate with another one's key) is kept out; the last good one serves.
    volume.write({"tls.crt": old_server.cert, "tls.key": new_server.key, "ca.crt": new.cert})
    wait_until(lambda: "do not load" in ext.log(), timeout=10, message="the broken set noticed")
    assert served(ext.port) == der(new_server)
    ext.client = (new_client.cert, new_client.key)
    assert ext.filter(body, "n1")[0] == 200
    assert ext.log().count("TLS certificates reloaded") == 1
    assert ext.process is not None and ext.process.poll() is None  # never restarted
