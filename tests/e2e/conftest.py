"""The end-to-end suite's world: one real local cluster for the session, one namespace per test."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from gpushared import __version__
from tests.e2e.cluster import ROOT, LocalCluster
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


#: What `make image` and `make node-image` export; the Makefile's e2e target builds them first.
EXTENDER_IMAGE = ROOT / "dist" / f"gpushared-extender_{__version__}.tar"
NODE_IMAGE = ROOT / "dist" / f"gpushared-node_{__version__}.tar"


def imported(cluster: LocalCluster, archive: Path, target: str) -> Path:
    """``archive`` in the node's containerd; a missing one fails the test, naming what builds it."""
    if not archive.exists():
        pytest.fail(f"{archive.relative_to(ROOT)} is missing: `make e2e` builds it (`make {target}`)")
    cluster.node.import_image(archive)
    return archive


@pytest.fixture
def extender_image(cluster: LocalCluster) -> Path:
    return imported(cluster, EXTENDER_IMAGE, "image")


@pytest.fixture
def node_image(cluster: LocalCluster) -> Path:
    return imported(cluster, NODE_IMAGE, "node-image")


@pytest.fixture
def restored(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Afterwards: the extender process on the cluster's own certificates, kube-scheduler wired to it."""
    own = cluster.scheduling.extender_certs
    yield cluster
    cluster.scheduling.restart_extender(certs=own)
    cluster.scheduling.restart_scheduler()
