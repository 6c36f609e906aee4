"""The Kubernetes client as gpushared sets it up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpushared.kube import api

KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
    "users": [{"name": "u", "user": {"token": "secret"}}],
    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
    "current-context": "x",
}


def test_credentials_are_looked_at_once_a_second_not_before_every_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's credentials hook re-reads every environment variable for proxies before each request
    (the loader sets the host again): a cost per API call that the bind path paid twice."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(KUBECONFIG))
    client = api.connect(kubeconfig)
    lookups: list[Any] = []
    monkeypatch.setattr("kubernetes.client.configuration.getproxies", lambda: lookups.append(1) or {})
    now = [1000.0]
    monkeypatch.setattr(api.time, "monotonic", lambda: now[0])
    for _ in range(50):
        assert client.configuration.auth_settings()["BearerToken"]["value"] == "Bearer secret"
    assert len(lookups) == 1
    now[0] += api.REFRESH_SECONDS
    for _ in range(50):
        client.configuration.auth_settings()
    assert len(lookups) == 2
