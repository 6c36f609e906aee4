"""The end-to-end suite's world: one real local cluster for the session, one namespace per test."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator

import pytest
from kubernetes import client, config

from tests.e2e.cluster import LocalCluster
from tests.e2e.kube import Kube


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    if os.geteuid() != 0:
        pytest.fail("the end-to-end suite needs root (kubelet, containerd): run `make e2e` as root")
    local = LocalCluster()
    local.up()
    yield local
    local.down()
    left = local.leftovers()
    assert not left, f"teardown left processes running: {left}"


@pytest.fixture(scope="session")
def kube(cluster: LocalCluster) -> Kube:
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    return Kube(core=client.CoreV1Api(api), cluster=cluster)


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace; deleted afterwards, and waited for, so the next test starts with free GPUs."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_"))[:40].strip("-")
    name = f"{name}-{secrets.token_hex(2)}"
    kube.create_namespace(name)
    yield name
    kube.delete_namespace(name)
