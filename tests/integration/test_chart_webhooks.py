"""The chart's optional webhooks (tests/integration/test_chart.py renders the rest): the claim allocator's
and the steerer's, each the objects deploy/ ships and the flag the extender runs with, off by default."""

from __future__ import annotations

from tests.integration import test_chart
from tests.integration.test_chart import Render, container, one, shipped

#: the chart's fixtures: helm, and a render of the chart with it
helm, render = test_chart.helm, test_chart.render


def test_the_claim_allocator_is_deploy_dras_and_the_extender_runs_it(render: Render) -> None:
    """dra.claimAllocator.enabled: the RBAC and webhook of deploy/dra/claim-allocator.yaml (the release's
    namespace), and the extender's flags; off by default, and only with dra.enabled."""
    on = ("--set", "dra.enabled=true", "--set", "dra.claimAllocator.enabled=true", "-n", "kube-system")
    docs = render(*on, "--set", "dra.claimAllocator.handoverAfterSeconds=45")
    source = shipped("dra/claim-allocator.yaml")
    assert (
        one(docs, "ClusterRole", "gpushared-claim-allocator")["rules"]
        == one(source, "ClusterRole", "gpushared-claim-allocator")["rules"]
    )
    binding = one(docs, "ClusterRoleBinding", "gpushared-claim-allocator")
    assert binding["subjects"] == one(source, "ClusterRoleBinding", "gpushared-claim-allocator")["subjects"]
    (ours,) = one(docs, "MutatingWebhookConfiguration", "gpushared-claim-allocator")["webhooks"]
    (theirs,) = one(source, "MutatingWebhookConfiguration", "gpushared-claim-allocator")["webhooks"]
    ours["clientConfig"].pop("caBundle", None)
    assert ours == theirs
    args = container(one(docs, "Deployment", "gpushared-extender"))["args"]
    assert "--claim-allocator" in args and "--claim-handover-after=45" in args
    assert "--dra-device-class=gpu-mem.gpushared.io" in args
    for off in (render("--set", "dra.enabled=true"), render("--set", "dra.claimAllocator.enabled=true")):
        assert "--claim-allocator" not in container(one(off, "Deployment", "gpushared-extender"))["args"]
        assert not [d for d in off if d["metadata"]["name"] == "gpushared-claim-allocator"]


def test_the_steerer_is_deploy_steers_and_the_extender_runs_it(render: Render) -> None:
    """extender.steerCpuPods: the RBAC and webhook of deploy/managed/steer.yaml (the release's namespace), and the
    extender's flag; off by default."""
    docs = render("--set", "extender.steerCpuPods=true", "-n", "kube-system")
    source = shipped("managed/steer.yaml")
    assert (
        one(docs, "ClusterRole", "gpushared-steer")["rules"] == one(source, "ClusterRole", "gpushared-steer")["rules"]
    )
    binding = one(docs, "ClusterRoleBinding", "gpushared-steer")
    assert binding["subjects"] == one(source, "ClusterRoleBinding", "gpushared-steer")["subjects"]
    (ours,) = one(docs, "MutatingWebhookConfiguration", "gpushared-steer")["webhooks"]
    (theirs,) = one(source, "MutatingWebhookConfiguration", "gpushared-steer")["webhooks"]
    ours["clientConfig"].pop("caBundle", None)
    assert ours == theirs
    assert "--steer-cpu-pods" in container(one(docs, "Deployment", "gpushared-extender"))["args"]
    off = render()
    assert "--steer-cpu-pods" not in container(one(off, "Deployment", "gpushared-extender"))["args"]
    assert not [d for d in off if d["metadata"]["name"] == "gpushared-steer"]
