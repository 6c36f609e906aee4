"""The node daemon renews its own ServiceAccount token before it expires (issue #42): the fake API server
issues bound tokens that live 4 s and refuses them (401) once they have expired, as a real one does, so a
daemon that did not renew would lose the API server within seconds. Renewals that fail are reported."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import yaml

from gpushared.core.node.tokens import read_bound_token
from tests.fakes.apiserver import Fault
from tests.harness import NODE, Daemon, wait_until
from tests.integration.test_daemon import started

LIFETIME = 4.0
ACCOUNT = ("kube-system", "gpushared-node")


def with_token(daemon: Daemon, *, seconds: float = LIFETIME) -> Path:
    """The daemon's kubeconfig holding a bound token of gpushared-node; where it keeps the renewed one."""
    api = daemon.api
    api.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT[1], "namespace": ACCOUNT[0]}}
    )
    api.max_token_seconds = seconds  # an API server that caps every token it issues at a few seconds
    saved = daemon.workdir / "state" / "token"
    daemon.write_config(renewedTokenFile=str(saved))
    kubeconfig: dict[str, Any] = api.kubeconfig()
    kubeconfig["users"][0]["user"]["token"] = api.issue_token(*ACCOUNT, seconds=seconds)
    (daemon.workdir / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    return saved


def metric(daemon: Daemon, name: str) -> float | None:
    for line in daemon.metrics_text().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_the_daemon_renews_its_token_and_keeps_working_past_many_lifetimes(daemon: Daemon) -> None:
    saved = with_token(daemon)
    started(daemon)
    began = time.time()
    # Three lifetimes later the daemon still reaches the API server: the tokens it asked for are in use.
    wait_until(lambda: time.time() - began > 3 * LIFETIME, timeout=20, interval=0.2, message="three lifetimes")
    daemon.admit(daemon.place("late", 2, gpu=0))  # Allocate reads the pod from the API server: the token in use
    wait_until(lambda: any(p["assigned"] for p in daemon.status()["pods"]), message="the late pod marked assigned")
    requests = [r for r in daemon.api.requests if r.path.endswith("/serviceaccounts/gpushared-node/token")]
    assert len(requests) >= 3
    # No request went out with an expired token: each was renewed before it ran out.
    assert daemon.api.expired_refusals == 0
    token = saved.read_text()
    claims = read_bound_token(token)
    assert claims is not None and (claims.namespace, claims.service_account) == ACCOUNT
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600
    expiry = metric(daemon, "gpushared_credential_expiry_seconds")
    assert expiry is not None and expiry >= claims.expires_at - LIFETIME
    assert "renewed the token of kube-system/gpushared-node" in daemon.log()


def test_a_failed_renewal_is_an_event_on_the_node_and_is_tried_again(daemon: Daemon) -> None:
    # 20 s: renewal is due at 16 s, fails twice (retried each second: a tenth of what is left, at least 1 s)
    # and succeeds at 18 s, before the token runs out.
    with_token(daemon, seconds=20.0)
    daemon.api.faults.append(Fault("POST", "/serviceaccounts/gpushared-node/token", status=403, times=2))
    daemon.start()
    daemon.notify.wait_for("READY=1")

    def reported() -> list[dict[str, Any]]:
        events = daemon.api.objects("events")
        return [
            e for e in events if e.get("reason") == "CredentialRenewalFailed" and e["involvedObject"]["name"] == NODE
        ]

    (event,) = wait_until(reported, timeout=20, message="CredentialRenewalFailed on the Node")
    assert event["type"] == "Warning" and "serviceaccounts/token create" in event["message"]
    wait_until(lambda: "renewed the token" in daemon.log(), timeout=20, message="renewed once the API server allows it")
    assert metric(daemon, "gpushared_credential_renewal_failures_total") == 2
    assert len(reported()) == 1  # one Event per run of failures
    assert daemon.api.expired_refusals == 0
