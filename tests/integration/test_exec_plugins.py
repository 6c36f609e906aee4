"""Exec plugins run the way kubectl runs them (``gpushared.kube.credentials.ExecCredential``): real processes,
so here rather than among the unit tests."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from gpushared.kube import credentials as creds
from gpushared.kube.errors import KubeError
from tests.unit.test_credentials import kubeconfig, load


def exec_plugin(tmp_path: Path, script: str) -> dict[str, Any]:
    """A kubeconfig user whose exec plugin is ``script`` (a shell script, next to the kubeconfig)."""
    plugin = tmp_path / "bin" / "get-token"
    plugin.parent.mkdir(exist_ok=True)
    plugin.write_text("#!/bin/sh\n" + script)
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "./bin/get-token",  # relative with a slash: the kubeconfig's folder
            "args": ["--cluster", "c"],
            "env": [{"name": "PLUGIN_SAYS", "value": "hello"}],
            "interactiveMode": "Never",
            "provideClusterInfo": True,
            "installHint": "install get-token from the vendor",
        }
    }


def credential_json(token: str, expires: str | None = None, **status: str) -> str:
    body = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": {"token": token}}
    if expires:
        body["status"]["expirationTimestamp"] = expires
    body["status"].update(status)
    return json.dumps(body)


def test_an_exec_plugin_is_run_with_its_args_env_and_the_cluster_and_its_token_cached(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    script = f"echo \"$* $PLUGIN_SAYS $KUBERNETES_EXEC_INFO\" >> {calls}\necho '{credential_json('tok-1')}'\n"
    loaded = load(kubeconfig(exec_plugin(tmp_path, script)), tmp_path)
    assert loaded.credential.authorization() == "Bearer tok-1"
    assert loaded.credential.authorization() == "Bearer tok-1"
    (line,) = calls.read_text().splitlines()
    args, said, info = line.split(" ", 3)[:2], line.split(" ", 3)[2], json.loads(line.split(" ", 3)[3])
    assert (args, said) == (["--cluster", "c"], "hello")
    assert info == {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "spec": {"interactive": False, "cluster": {"server": "https://api.example:6443"}},
    }


def test_an_exec_credential_is_fetched_again_before_it_expires_and_when_refused(tmp_path: Path) -> None:
    counter = tmp_path / "n"
    counter.write_text("0")
    script = (
        f"n=$(($(cat {counter}) + 1)); echo $n > {counter}\n"
        f'printf \'{{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential",'
        f'"status":{{"token":"tok-%s","expirationTimestamp":"2030-01-01T00:00:00Z"}}}}\' $n\n'
    )
    loaded = load(kubeconfig(exec_plugin(tmp_path, script)), tmp_path)
    credential = loaded.credential
    assert isinstance(credential, creds.ExecCredential)
    expiry = 1893456000.0  # 2030-01-01T00:00:00Z
    now = [expiry - 3600]
    credential.clock = lambda: now[0]
    assert credential.authorization() == "Bearer tok-1"
    now[0] = expiry - creds.EXEC_EARLY_SECONDS  # about to expire: fetched again
    assert credential.authorization() == "Bearer tok-2"
    now[0] = expiry - 3600 * 2
    assert credential.refused("Bearer tok-1") is True  # an old token refused: the current one is worth a try
    assert credential.refused("Bearer tok-2") is True  # the current one refused: fetched again
    assert credential.authorization() == "Bearer tok-3"


EXEC_FAILURES = [
    (
        "exit 3 after a message",
        "echo 'token expired, run login' >&2\nexit 3\n",
        "exit status 3: token expired, run login",
    ),
    ("not JSON", "echo hello\n", "printed no ExecCredential JSON"),
    ("another kind", 'echo \'{"kind": "Secret"}\'\n', "printed no ExecCredential"),
    (
        "another apiVersion",
        'echo \'{"kind": "ExecCredential", "apiVersion": "client.authentication.k8s.io/v1beta1"}\'\n',
        "the kubeconfig asks client.authentication.k8s.io/v1",
    ),
    ("no token or certificate", f"echo '{credential_json('')}'\n", "neither a token nor a client certificate"),
    ("a certificate alone", f"echo '{credential_json('', clientCertificateData='C')}'\n", "without its key"),
    ("a bad expiry", f"echo '{credential_json('t', expires='tomorrow')}'\n", "is not RFC 3339"),
]


@pytest.mark.parametrize(("case", "script", "message"), EXEC_FAILURES, ids=[c[0] for c in EXEC_FAILURES])
def test_an_exec_plugin_that_fails_is_a_precise_error(tmp_path: Path, case: str, script: str, message: str) -> None:
    loaded = load(kubeconfig(exec_plugin(tmp_path, script)), tmp_path)
    with pytest.raises(KubeError, match=f"^exec plugin {tmp_path}/bin/get-token: ") as failed:
        loaded.credential.authorization()
    assert message in str(failed.value)


def test_a_missing_exec_plugin_gives_its_install_hint(tmp_path: Path) -> None:
    user = exec_plugin(tmp_path, "")
    user["exec"]["command"] = "gpushared-no-such-plugin"
    with pytest.raises(KubeError, match=r"not found \(install get-token from the vendor\)"):
        load(kubeconfig(user), tmp_path).credential.authorization()


def test_an_exec_plugin_that_gives_a_certificate_changes_the_identity(tmp_path: Path) -> None:
    cert = credential_json("", clientCertificateData="CERT", clientKeyData="KEY")
    loaded = load(kubeconfig(exec_plugin(tmp_path, f"echo '{cert}'\n")), tmp_path)
    assert loaded.credential.identity() == creds.Identity(b"CERT", b"KEY")
    assert loaded.credential.authorization() is None


def test_an_interactive_only_plugin_refuses_without_a_terminal(tmp_path: Path) -> None:
    user = exec_plugin(tmp_path, f"echo '{credential_json('t')}'\n")
    user["exec"]["interactiveMode"] = "Always"
    with pytest.raises(KubeError, match="needs a terminal"):
        load(kubeconfig(user), tmp_path).credential.authorization()


def test_an_exec_plugin_that_hangs_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin waiting on a login prompt nobody sees must not hold the daemon's calls forever."""
    monkeypatch.setattr(creds, "EXEC_TIMEOUT_SECONDS", 0.3)
    loaded = load(kubeconfig(exec_plugin(tmp_path, "exec sleep 30\n")), tmp_path)
    with pytest.raises(KubeError, match=r"timed out after 0\.3 seconds"):
        loaded.credential.authorization()
