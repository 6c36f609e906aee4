"""The Helm chart (deploy/helm/gpushared), rendered by the real helm (scripts/helm-bin) for the Kubernetes
versions users run and the one CI runs: what it installs is served by that version, is what the kustomize
manifests in deploy/ install (the same RBAC, arguments, probes, wiring), and is safe by default. Installing
it on a real cluster, `helm test` and renewal on upgrade are tests/e2e/test_helm.py."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpushared import __version__
from gpushared.daemon.config import load as load_daemon_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpushared"
DEPLOY = ROOT / "deploy"
NAMESPACE = "gpu-system"

#: The Kubernetes versions every render is checked for: Debian's (CI's cluster), and two that users run.
VERSIONS = ["1.20.2", "1.29.3", "1.36.0"]

#: (apiVersion, kind) -> the minor versions that serve it (first, last). Upstream's deprecation guide.
SERVED: dict[tuple[str, str], tuple[int, int]] = {
    **{("v1", kind): (0, 99) for kind in ("ServiceAccount", "Secret", "ConfigMap", "Service", "Pod")},
    **{
        ("rbac.authorization.k8s.io/v1", kind): (8, 99)
        for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    },
    ("apps/v1", "Deployment"): (9, 99),
    ("apps/v1", "DaemonSet"): (9, 99),
    ("policy/v1", "PodDisruptionBudget"): (21, 99),
    ("policy/v1beta1", "PodDisruptionBudget"): (5, 24),
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): (16, 99),
    ("networking.k8s.io/v1", "NetworkPolicy"): (7, 99),
    ("resource.k8s.io/v1", "DeviceClass"): (34, 99),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): (30, 99),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): (30, 99),
}
#: KubeSchedulerConfiguration, inside the ConfigMap: which API versions kube-scheduler reads.
SCHEDULER_CONFIG_SERVED = {
    "kubescheduler.config.k8s.io/v1beta1": (18, 22),
    "kubescheduler.config.k8s.io/v1beta3": (23, 28),
    "kubescheduler.config.k8s.io/v1": (25, 99),
}


@pytest.fixture(scope="session")
def helm() -> Path:
    """helm v3.17 from where it ships as a Linux binary (downloaded once, pinned by SHA-256)."""
    result = subprocess.run([ROOT / "scripts" / "helm-bin"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"scripts/helm-bin: {result.stderr}"
    return Path(result.stdout.strip().splitlines()[-1]) / "helm"


Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def render(helm: Path) -> Render:
    def run(*args: str, version: str = "1.36.0") -> list[dict[str, Any]]:
        argv = [helm, "template", "gpushared", CHART, "-n", NAMESPACE, "--kube-version", version, *args]
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        return [d for d in yaml.safe_load_all(result.stdout) if d]

    return run


def refused(helm: Path, *args: str) -> str:
    result = subprocess.run(
        [helm, "template", "gpushared", CHART, "-n", NAMESPACE, *args], capture_output=True, text=True, check=False
    )
    assert result.returncode != 0, "rendered although it must not"
    return result.stderr


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def shipped(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_lint_is_clean(helm: Path) -> None:
    result = subprocess.run([helm, "lint", "--strict", CHART], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_is_gpushareds_release() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__


@pytest.mark.parametrize("version", VERSIONS)
def test_everything_rendered_is_served_by_the_clusters_version(render: Render, version: str) -> None:
    minor = int(version.split(".")[1])
    dra = ("--set", "dra.enabled=true") if minor >= 34 else ()
    docs = render("--set", "node.daemonset.enabled=true", *dra, version=version)
    assert one(docs, "DaemonSet", "gpushared-node")
    assert bool(dra) == any(d["kind"] == "DeviceClass" for d in docs)
    for doc in docs:
        first, last = SERVED[(doc["apiVersion"], doc["kind"])]
        assert first <= minor <= last, f"{doc['apiVersion']} {doc['kind']} is not served by {version}"
        assert doc["metadata"].get("namespace", NAMESPACE) in (NAMESPACE, "kube-system")
    config = yaml.safe_load(one(docs, "ConfigMap", "gpushared-scheduler")["data"]["config.yaml"])
    first, last = SCHEDULER_CONFIG_SERVED[config["apiVersion"]]
    assert first <= minor <= last, f"kube-scheduler {version} does not read {config['apiVersion']}"
    # kube-scheduler of the cluster's own version: never newer than the API server.
    scheduler = container(one(docs, "Deployment", "gpushared-scheduler"))
    assert scheduler["image"] == f"registry.k8s.io/kube-scheduler:v{version}"
    extender = container(one(docs, "Deployment", "gpushared-extender"))
    assert extender["image"] == f"localhost/gpushared-extender:{__version__}"


def test_a_managed_clusters_version_suffix_is_not_an_image_tag(render: Render) -> None:
    docs = render(version="1.29.3-eks-4d3b2a1")
    assert container(one(docs, "Deployment", "gpushared-scheduler"))["image"].endswith(":v1.29.3")
    docs = render("--set", "scheduler.image.tag=v1.29.9", version="1.29.3-gke.1000")
    assert container(one(docs, "Deployment", "gpushared-scheduler"))["image"].endswith(":v1.29.9")


def rules(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(doc["rules"], key=json.dumps)


def test_rbac_is_the_kustomize_manifests_rbac(render: Render) -> None:
    """The chart grants exactly what deploy/ grants: the extender reads nodes and pods and creates Bindings,
    the node identity what the daemon calls, the scheduler the built-in scheduler roles and one Lease."""
    docs = render()
    extender, node, scheduler = (
        shipped("extender.yaml"),
        shipped("node-rbac.yaml"),
        shipped("managed/gpushared-scheduler.yaml"),
    )
    for kind, name, source in [
        ("ClusterRole", "gpushared-extender", extender),
        ("Role", "gpushared-extender-lease", extender),
        ("ClusterRole", "gpushared-node", node),
        ("Role", "gpushared-node-token", node),
        ("Role", "gpushared-scheduler-lease", scheduler),
    ]:
        assert rules(one(docs, kind, name)) == rules(one(source, kind, name)), name
    for name in (
        "gpushared-scheduler-as-kube-scheduler",
        "gpushared-scheduler-as-volume-scheduler",
        "gpushared-extender",
        "gpushared-node",
    ):
        source = one(extender + node + scheduler, "ClusterRoleBinding", name)
        ours = one(docs, "ClusterRoleBinding", name)
        assert ours["roleRef"] == source["roleRef"]
        assert [s | {"namespace": "kube-system"} for s in ours["subjects"]] == source["subjects"]
    # Nothing in the chart grants more than these.
    granted = {d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "Role")}
    assert granted == {
        "gpushared-extender",
        "gpushared-extender-lease",
        "gpushared-node",
        "gpushared-node-token",
        "gpushared-scheduler-lease",
    }


def test_the_extender_runs_as_the_kustomize_deployment_does(render: Render) -> None:
    docs = render()
    ours, theirs = (
        one(docs, "Deployment", "gpushared-extender"),
        one(shipped("extender.yaml"), "Deployment", "gpushared-extender"),
    )
    mine, source = container(ours), container(theirs)
    # The same arguments, but the Secret's CA key (cert-manager's layout), the release's namespace for the
    # Lease, and the webhook's scheduler name, which the chart passes explicitly.
    expected = [
        arg.replace("client-ca.crt", "ca.crt").replace("=kube-system", f"={NAMESPACE}") for arg in source["args"]
    ]
    assert mine["args"] == [*expected, "--webhook-scheduler=gpushared-scheduler"]
    assert mine["env"] == source["env"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert mine[probe] == source[probe], probe
    assert mine["securityContext"] == source["securityContext"]
    assert mine["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert mine["resources"] == source["resources"]
    spec, source_spec = ours["spec"]["template"]["spec"], theirs["spec"]["template"]["spec"]
    assert spec["securityContext"] == source_spec["securityContext"]
    assert spec["affinity"] == source_spec["affinity"]
    assert ours["spec"]["replicas"] == theirs["spec"]["replicas"] == 2
    pdb = one(docs, "PodDisruptionBudget", "gpushared-extender")["spec"]
    assert pdb == one(shipped("extender.yaml"), "PodDisruptionBudget", "gpushared-extender")["spec"]


def test_the_second_scheduler_and_webhook_are_the_kustomize_ones(render: Render) -> None:
    docs, source = render(), shipped("managed/gpushared-scheduler.yaml")
    ours = yaml.safe_load(one(docs, "ConfigMap", "gpushared-scheduler")["data"]["config.yaml"])
    theirs = yaml.safe_load(one(source, "ConfigMap", "gpushared-scheduler")["data"]["config.yaml"])
    (mine,), (their,) = ours.pop("extenders"), theirs.pop("extenders")
    assert ours["leaderElection"] == theirs["leaderElection"] | {"resourceNamespace": NAMESPACE}
    assert ours["profiles"] == theirs["profiles"]
    assert mine["urlPrefix"] == f"https://gpushared-extender.{NAMESPACE}.svc:39999/gpushare-scheduler"
    assert mine["tlsConfig"] == {k: f"/etc/kubernetes/gpushared/{f}" for k, f in
                                 [("certFile", "tls.crt"), ("keyFile", "tls.key"), ("caFile", "ca.crt")]}  # fmt: skip
    drop = ("urlPrefix", "tlsConfig")
    assert {k: v for k, v in mine.items() if k not in drop} == {k: v for k, v in their.items() if k not in drop}
    scheduler = container(one(docs, "Deployment", "gpushared-scheduler"))
    shipped_scheduler = container(one(source, "Deployment", "gpushared-scheduler"))
    for field in ("command", "startupProbe", "livenessProbe", "readinessProbe", "securityContext", "volumeMounts"):
        assert scheduler[field] == shipped_scheduler[field], field
    (webhook,) = one(docs, "MutatingWebhookConfiguration", "gpushared-scheduler")["webhooks"]
    (shipped_webhook,) = one(source, "MutatingWebhookConfiguration", "gpushared-scheduler")["webhooks"]
    for field in ("name", "rules", "failurePolicy", "sideEffects", "timeoutSeconds", "admissionReviewVersions"):
        assert webhook[field] == shipped_webhook[field], field
    assert webhook["clientConfig"]["service"] == shipped_webhook["clientConfig"]["service"] | {"namespace": NAMESPACE}
    # The release's namespace is never sent to the second scheduler: the extender itself runs there.
    (exempt,) = [
        e for e in webhook["namespaceSelector"]["matchExpressions"] if e["key"] == "kubernetes.io/metadata.name"
    ]
    assert exempt == {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", NAMESPACE]}


def openssl(*args: str | Path, input: bytes | None = None) -> str:
    result = subprocess.run(["openssl", *map(str, args)], input=input, capture_output=True, check=False)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


def test_the_charts_own_certificates_are_one_ca_and_two_leaves(render: Render, tmp_path: Path) -> None:
    """Without cert-manager: ECDSA P-256 as scripts/extender-certs makes them; the extender's names its
    Service and loopback, the scheduler's is CN=system:kube-scheduler; the webhook trusts the same CA."""
    docs = render("--set", "extender.clusterIP=10.96.0.77")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert set(secrets) == {"gpushared-ca", "gpushared-extender-tls", "gpushared-scheduler-tls"}
    ca = base64.b64decode(secrets["gpushared-ca"]["data"]["tls.crt"])
    (tmp_path / "ca.crt").write_bytes(ca)
    (webhook,) = one(docs, "MutatingWebhookConfiguration", "gpushared-scheduler")["webhooks"]
    assert base64.b64decode(webhook["clientConfig"]["caBundle"]) == ca
    for name, subject, names in [
        ("gpushared-extender-tls", "CN = gpushared-extender",
         ["DNS:gpushared-extender.gpu-system.svc", "DNS:gpushared-extender.gpu-system.svc.cluster.local",
          "IP Address:127.0.0.1", "IP Address:10.96.0.77"]),
        ("gpushared-scheduler-tls", "CN = system:kube-scheduler", []),
    ]:  # fmt: skip
        data = {k: base64.b64decode(v) for k, v in secrets[name]["data"].items()}
        assert data["ca.crt"] == ca
        (tmp_path / name).write_bytes(data["tls.crt"])
        assert openssl("verify", "-CAfile", tmp_path / "ca.crt", tmp_path / name).strip().endswith("OK")
        text = openssl("x509", "-noout", "-text", "-in", tmp_path / name)
        assert f"Subject: {subject}" in text.replace("Subject: CN=", "Subject: CN = ")
        assert "id-ecPublicKey" in text and "prime256v1" in text
        assert all(n in text for n in names), text
        assert "BEGIN EC PRIVATE KEY" in data["tls.key"].decode()
        annotations = secrets[name]["metadata"]["annotations"]
        assert int(annotations["gpushared.io/not-after"]) > 0
    # A certificate issued again rolls kube-scheduler (it reads its client certificate once); the extender
    # reads its files again by itself (--tls-reload-seconds), so its pods stay.
    assert (
        "checksum/tls" in one(docs, "Deployment", "gpushared-scheduler")["spec"]["template"]["metadata"]["annotations"]
    )
    assert "annotations" not in one(docs, "Deployment", "gpushared-extender")["spec"]["template"]["metadata"]


def test_cert_manager_issues_them_where_it_is_installed(render: Render) -> None:
    docs = render("--api-versions", "cert-manager.io/v1")
    assert not [d for d in docs if d["kind"] == "Secret"]
    certificates = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    assert set(certificates) == {"gpushared-ca", "gpushared-extender", "gpushared-scheduler"}
    assert certificates["gpushared-ca"]["isCA"] is True
    assert certificates["gpushared-extender"]["secretName"] == "gpushared-extender-tls"
    assert "server auth" in certificates["gpushared-extender"]["usages"]
    assert certificates["gpushared-scheduler"]["commonName"] == "system:kube-scheduler"
    for spec in certificates.values():
        assert spec["renewBefore"] == "720h"
    webhook = one(docs, "MutatingWebhookConfiguration", "gpushared-scheduler")
    assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/gpushared-extender"
    assert "caBundle" not in webhook["webhooks"][0]["clientConfig"]
    # Forced off, the chart makes its own even where cert-manager is served.
    docs = render("--api-versions", "cert-manager.io/v1", "--set", "tls.certManager=false")
    assert not [d for d in docs if d["kind"] == "Certificate"]
    assert len([d for d in docs if d["kind"] == "Secret"]) == 3


def test_no_network_policy_unless_its_addresses_are_given(render: Render, helm: Path) -> None:
    assert not [d for d in render() if d["kind"] == "NetworkPolicy"]
    error = refused(helm, "--set", "networkPolicy.enabled=true")
    assert "networkPolicy.controlPlaneCIDRs" in error and "block scheduling" in error
    docs = render(
        "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.controlPlaneCIDRs={10.0.0.10/32,10.0.0.11/32}"
    )
    chart = one(docs, "NetworkPolicy", "gpushared-extender")
    sources = chart["spec"]["ingress"][0]["from"]
    assert [s["ipBlock"]["cidr"] for s in sources if "ipBlock" in s] == ["10.0.0.10/32", "10.0.0.11/32"]
    # The policy scripts/extender-networkpolicy makes for plain manifests is the chart's, labels aside.
    made = subprocess.run(
        [sys.executable, ROOT / "scripts" / "extender-networkpolicy", "--cidr", "10.0.0.10/32", "--cidr", "10.0.0.11",
         "--namespace", chart["metadata"]["namespace"]],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert json.loads(made) == {**chart, "metadata": {k: v for k, v in chart["metadata"].items() if k != "labels"}}
    cidrs = ("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.controlPlaneCIDRs={ten}")
    assert "networkPolicy.controlPlaneCIDRs.0" in refused(helm, *cidrs)  # not a CIDR: the schema says which


def test_the_node_daemonset_is_off_unless_asked(render: Render) -> None:
    assert not [d for d in render() if d["kind"] == "DaemonSet"]


def test_the_node_daemonset_runs_the_daemon_on_the_nodes_paths(render: Render, tmp_path: Path) -> None:
    """The DaemonSet's pod: the daemon's own config parser accepts what the chart wrote, the node's driver
    root is where that config says, every host path is mounted where the daemon and the kubelet agree on
    it, and the credential is the pod's ServiceAccount (no kubeconfig)."""
    docs = render(
        "--set", "node.daemonset.enabled=true",
        "--set", "node.daemonset.driverRoot=/home/kubernetes/bin/nvidia",
        "--set", "node.daemonset.kubeletDir=/var/lib/kubelet/",
        "--set", "node.daemonset.config.mps.enabled=true",
        "--set", "node.daemonset.config.metrics.port=9555",
    )  # fmt: skip
    written = tmp_path / "config.yaml"
    written.write_text(one(docs, "ConfigMap", "gpushared-node")["data"]["config.yaml"])
    config = load_daemon_config(written, env={"GPUSHARED_NODE_NAME": "gpu-1"}, required=True)
    assert (str(config.driver_root), str(config.kubelet_dir), config.mps_enabled) == (
        "/driver-root",
        "/var/lib/kubelet",
        True,
    )
    assert config.exposure.device_nodes and config.exposure.dev_root == "/"
    daemonset = one(docs, "DaemonSet", "gpushared-node")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpushared-node" and pod["hostPID"] is True
    assert pod["nodeSelector"] == {"gpushared.io/node-daemon": "daemonset"}  # never beside the .deb unasked
    (daemon,) = pod["containers"]
    assert daemon["securityContext"] == {"privileged": True}
    # the probes on the health port, which strangers holding the metrics port's connections cannot starve
    assert daemon["livenessProbe"]["httpGet"]["port"] == daemon["readinessProbe"]["httpGet"]["port"] == 9403
    assert config.metrics_health_port == 9403 and config.metrics_port == 9555
    assert not [e for e in daemon["env"] if "KUBECONFIG" in e["name"]]
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    assert volumes["driver-root"] == "/home/kubernetes/bin/nvidia" and mounts["driver-root"] == "/driver-root"
    for name in ("device-plugins", "pod-resources", "run", "dev"):
        assert volumes[name] == mounts[name], name  # the kubelet's and the runtime's paths, unchanged
    assert mounts["device-plugins"] == str(config.plugin_dir)
    assert mounts["pod-resources"] == str(config.pod_resources_socket.parent)
    run = next(m for m in daemon["volumeMounts"] if m["name"] == "run")
    assert run["mountPropagation"] == "Bidirectional"  # MPS shm mounts reach the host, where clients mount them


def test_dra_ships_deploy_dras_objects_and_runs_the_daemonset_as_a_dra_driver(render: Render, tmp_path: Path) -> None:
    """dra.enabled (Kubernetes >= 1.34): the DeviceClass, RBAC and admission policy of deploy/dra/, and the
    DaemonSet in mode: dra with the kubelet's plugin directories and the CDI directory at the node's paths."""
    docs = render("--set", "dra.enabled=true", "--set", "node.daemonset.enabled=true", "-n", "kube-system")
    source = [
        d for name in ("deviceclass.yaml", "driver-rbac.yaml", "admission-policy.yaml") for d in shipped(f"dra/{name}")
    ]
    for kind, name in [
        ("DeviceClass", "gpu-mem.gpushared.io"),
        ("ClusterRole", "gpushared-dra-driver"),
        ("ValidatingAdmissionPolicy", "gpushared-dra-own-slices"),
        ("ValidatingAdmissionPolicyBinding", "gpushared-dra-own-slices"),
    ]:
        ours, theirs = one(docs, kind, name), one(source, kind, name)
        assert ours.get("spec", ours.get("rules")) == theirs.get("spec", theirs.get("rules")), name
    written = tmp_path / "config.yaml"
    written.write_text(one(docs, "ConfigMap", "gpushared-node")["data"]["config.yaml"])
    config = load_daemon_config(written, env={"GPUSHARED_NODE_NAME": "gpu-1"}, required=True)
    assert config.dra and str(config.cdi_root) == "/var/run/cdi"
    pod = one(docs, "DaemonSet", "gpushared-node")["spec"]["template"]["spec"]
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    for name in ("plugins", "plugins-registry", "cdi"):
        assert volumes[name] == mounts[name], name
    assert mounts["plugins"] == str(config.dra_checkpoint.parent.parent)
    assert mounts["plugins-registry"] == str(config.kubelet_dir / "plugins_registry")
    assert mounts["cdi"] == str(config.cdi_root)
    assert not [d for d in render("--set", "node.daemonset.enabled=true") if d["kind"] == "DeviceClass"]


def test_dra_needs_kubernetes_1_34(helm: Path) -> None:
    assert "dra.enabled needs Kubernetes 1.34 or later" in refused(
        helm, "--set", "dra.enabled=true", "--kube-version", "1.29.0"
    )
    on = ("--set", "node.daemonset.enabled=true")
    assert "node.daemonset.config" in refused(helm, *on, "--set", "node.daemonset.config.mode=dra")


@pytest.mark.parametrize("version", ["1.20.2", "1.36.0"])
def test_the_node_daemonset_never_runs_two_pods_on_a_node(render: Render, version: str) -> None:
    """An update stops the old pod before the new one starts: two daemons on a node would each count the
    GPUs without the other's pods and claims."""
    docs = render("--set", "node.daemonset.enabled=true", version=version)
    strategy = one(docs, "DaemonSet", "gpushared-node")["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 1
    # 1.20 has no maxSurge (it never surges); from 1.21 it is said: 0
    assert strategy["rollingUpdate"].get("maxSurge", 0) == 0
    assert ("maxSurge" in strategy["rollingUpdate"]) == (version != "1.20.2")


def test_the_node_daemonset_refusals(helm: Path) -> None:
    on = ("--set", "node.daemonset.enabled=true")
    assert "node.daemonset.enabled needs node.rbac" in refused(helm, *on, "--set", "node.rbac=false")
    assert "node.daemonset.driverRoot" in refused(helm, *on, "--set", "node.daemonset.driverRoot=relative")
    assert "node.daemonset.config" in refused(helm, *on, "--set", "node.daemonset.config.kubeconfig=/x")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("extender.policy=best", "extender.policy"),
        ("tls.certManager=maybe", "tls.certManager"),
        ("extender.replicas=0", "extender.replicas"),
        ("tls.days=10", "must be more than tls.renewBeforeDays"),
        ("webhook.failurePolicy=Sometimes", "webhook.failurePolicy"),
    ],
)
def test_values_out_of_range_are_refused_by_name(helm: Path, setting: str, message: str) -> None:
    assert message in refused(helm, "--set", setting)


def defined_metrics() -> set[str]:
    """Every metric name the code defines (string literals; the exporter adds _total, _bucket...)."""
    names: set[str] = set()
    for path in (ROOT / "gpushared").rglob("*.py"):
        names |= set(re.findall(r'"(gpushared_[a-z_]+)"', path.read_text()))
    return names


def metrics_in(expr: str) -> set[str]:
    return {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in re.findall(r"\bgpushared_[a-z_]+", expr)}


def test_alerts_and_dashboard_read_only_metrics_that_exist(render: Render) -> None:
    known = defined_metrics()
    docs = render(*(f"--set=metrics.{k}.enabled=true" for k in ("serviceMonitor", "prometheusRule", "dashboard")))
    groups = one(docs, "PrometheusRule", "gpushared")["spec"]["groups"]
    alerts = [rule for group in groups for rule in group["rules"]]
    assert len(alerts) >= 8
    for alert in alerts:
        assert metrics_in(alert["expr"]) and metrics_in(alert["expr"]) <= known, alert["alert"]
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
    dashboard = json.loads(one(docs, "ConfigMap", "gpushared-dashboard")["data"]["gpushared.json"])
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert metrics_in(target["expr"]) <= known and metrics_in(target["expr"]), panel["title"]
    monitor = one(docs, "ServiceMonitor", "gpushared-extender")["spec"]
    (endpoint,) = monitor["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["ca"]["secret"]["name"] == "gpushared-extender-tls"
    # Off by default: no Prometheus Operator objects on a cluster without its CRDs.
    assert not [d for d in render() if d["apiVersion"].startswith("monitoring.coreos.com")]


def test_helm_test_places_the_binpack_sample(render: Render) -> None:
    (pod,) = [d for d in render() if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["schedulerName"] == "gpushared-scheduler"
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["limits"] == {"aliyun.com/gpu-mem": 2}
    assert "ALIYUN_COM_GPU_MEM_IDX" in c["command"][-1] and "NVIDIA_VISIBLE_DEVICES" in c["command"][-1]
    # With the cluster's own scheduler wired to the extender, the test pod goes to it.
    (pod,) = [d for d in render("--set", "scheduler.enabled=false") if d["kind"] == "Pod"]
    assert "schedulerName" not in pod["spec"]
