"""daemon.credential: which token the daemon starts with, and what a renewal that fails does, against a
clock it is given (the API is never reached here: see tests/integration/test_daemon_credentials.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from gpushared.daemon.credential import TokenRenewer
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.kube.api import Api
from gpushared.kube.credentials import Credentials, StaticCredential
from gpushared.kube.rest import Rest


def token(*, issued: int, expires: int, account: str = "gpushared-node") -> str:
    claims = {
        "iat": issued,
        "exp": expires,
        "kubernetes.io": {"namespace": "kube-system", "serviceaccount": {"name": account, "uid": "u"}},
    }
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"eyJhbGciOiJSUzI1NiJ9.{payload}.sig"


def renewer(kubeconfig_token: str, saved: Path) -> TokenRenewer | None:
    api = Api(Rest(Credentials(server="http://127.0.0.1:1", credential=StaticCredential(token=kubeconfig_token))))
    return TokenRenewer.attach(api, saved=saved, node="n1", metrics=DaemonMetrics())


def test_a_token_renewed_before_the_restart_is_used(tmp_path: Path) -> None:
    saved = tmp_path / "token"
    saved.write_text(renewed := token(issued=2_000, expires=5_600))
    r = renewer(token(issued=1_000, expires=4_600), saved)
    assert r is not None and r.credential.token == renewed and r.current.issued_at == 2_000


def test_a_kubeconfig_written_since_wins_even_with_a_shorter_life(tmp_path: Path) -> None:
    saved = tmp_path / "token"
    saved.write_text(token(issued=2_000, expires=900_000))  # before the ServiceAccount was recreated
    fresh = token(issued=3_000, expires=6_600)
    r = renewer(fresh, saved)
    assert r is not None and r.credential.token == fresh


def test_another_accounts_or_a_broken_saved_token_is_ignored(tmp_path: Path) -> None:
    saved = tmp_path / "token"
    mine = token(issued=1_000, expires=4_600)
    for content in (token(issued=2_000, expires=5_600, account="someone-else"), "garbage", ""):
        saved.write_text(content)
        r = renewer(mine, saved)
        assert r is not None and r.credential.token == mine


def test_tokens_that_do_not_expire_are_not_renewed(tmp_path: Path) -> None:
    assert renewer("a-static-token", tmp_path / "token") is None
    assert renewer(token(issued=1_000, expires=4_600).replace(".sig", ""), tmp_path / "token") is None


def test_a_failed_renewal_is_retried_at_a_tenth_of_what_is_left(tmp_path: Path) -> None:
    r = renewer(token(issued=0, expires=3_600), tmp_path / "token")
    assert r is not None
    r.clock = lambda: 1_000.0
    assert r.due_in() == 2_880 - 1_000  # at 80 % of its life
    assert not r.renew()  # nothing listens at 127.0.0.1:1
    assert r.failures == 1 and r.due_in() == 60.0  # 2,600 s left: capped at a minute
    r.clock = lambda: 3_590.0
    assert r.due_in() == 1.0  # 10 s left: at least a second
    assert not (tmp_path / "token").exists()
