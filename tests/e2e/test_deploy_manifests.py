"""deploy/'s plain manifests against the real API server: they apply as they are (issue #52, item 11)."""

from __future__ import annotations

import re

import pytest

from tests.e2e.cluster import ROOT, LocalCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_kubectl_apply_f_deploy_applies_as_it_is(cluster: LocalCluster) -> None:
    """``kubectl apply -f deploy/`` with nothing edited, as the API server judges it (server-side dry run: the
    local cluster runs the extender as a process). From 1.30 every object is accepted; an older release
    refuses only the objects of APIs it does not serve yet (policy/v1 before 1.21, ValidatingAdmissionPolicy
    before 1.30), never a placeholder or a file that is not an API object."""
    result = cluster.kubectl("apply", "--dry-run=server", "-f", ROOT / "deploy", check=False)
    version = cluster.version()
    if version.at_least(30):
        assert result.returncode == 0, result.stderr
        return
    unserved = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    if not version.at_least(21):
        unserved.add("PodDisruptionBudget")
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert {m for line in errors for m in re.findall(r'no matches for kind "(\w+)"', line)} == unserved, errors
    assert all("no matches for kind" in line for line in errors), errors
    for accepted in ("deployment.apps/gpushared-extender", "clusterrole.rbac.authorization.k8s.io/gpushared-node"):
        assert re.search(rf"^{re.escape(accepted)} \w+ \(server dry run\)$", result.stdout, re.M), result.stdout
