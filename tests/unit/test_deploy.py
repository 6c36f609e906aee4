"""The manifests in deploy/: they parse, wire the extender as the code expects, and grant what it uses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpushared import __version__, contract
from tests.builders import scheduler_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


@pytest.mark.parametrize(
    ("name", "api_version"),
    [
        ("control-plane/scheduler-config.yaml", "kubescheduler.config.k8s.io/v1"),
        ("control-plane/scheduler-config-v1beta1.yaml", "kubescheduler.config.k8s.io/v1beta1"),
    ],
)
def test_scheduler_configs_wire_every_verb(name: str, api_version: str) -> None:
    (config,) = documents(name)
    assert config["apiVersion"] == api_version
    # Pods without GPU are scored only by opting in: that entry is called for every pod of the cluster.
    (extender,) = config["extenders"]
    opted_in = scheduler_config(DEPLOY / name, no_gpu_scoring=True)
    assert {k: v for k, v in opted_in.items() if k != "extenders"} == {
        k: v for k, v in config.items() if k != "extenders"
    }
    first, no_gpu = opted_in["extenders"]
    assert first == extender
    assert extender["urlPrefix"].endswith("/gpushare-scheduler")
    # The extender ranks in filter (its default): no prioritize call, the same choice (docs/install.md).
    assert (extender["filterVerb"], extender["bindVerb"], extender["preemptVerb"]) == ("filter", "bind", "preempt")
    assert "prioritizeVerb" not in extender and "weight" not in extender
    assert extender["nodeCacheCapable"] is True
    assert extender["httpTimeout"]
    # Before 1.22 GPU memory is the extender's alone: some of those kube-schedulers never call the preempt verb,
    # and their per-node count would preempt pods that free no GPU (the extender preempts itself there).
    assert {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]} == {
        "aliyun.com/gpu-mem": api_version.endswith("v1beta1"),
        "aliyun.com/gpu-count": False,
    }
    # Every pod, so that those without GPU are scored too; never needed for a pod to schedule.
    assert no_gpu["urlPrefix"] == extender["urlPrefix"]
    assert no_gpu["prioritizeVerb"] == "prioritize-no-gpu"
    assert "managedResources" not in no_gpu and "filterVerb" not in no_gpu and "bindVerb" not in no_gpu
    assert no_gpu["ignorable"] is True and no_gpu["nodeCacheCapable"] is True


def test_extender_deployment_runs_the_built_image_with_election() -> None:
    kinds = {d["kind"]: d for d in documents("extender.yaml")}
    deployment = kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"localhost/gpushared-extender:{__version__}"
    assert "--leader-elect" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    rules = kinds["ClusterRole"]["rules"]
    granted = {(res, verb) for rule in rules for res in rule["resources"] for verb in rule["verbs"]}
    # Exactly what the extender calls: the cache's lists and watches, a pod read back, its Binding, and
    # preemption's evictions, Events and the budgets it weighs. The GPU choice reaches the pod on its
    # Binding (no patch), and refusals reach the pod through kube-scheduler's own events.
    assert granted == {
        ("nodes", "get"),
        ("nodes", "list"),
        ("nodes", "watch"),
        ("pods", "get"),
        ("pods", "list"),
        ("pods", "watch"),
        ("pods/binding", "create"),
        ("bindings", "create"),
        ("pods/eviction", "create"),
        ("poddisruptionbudgets", "list"),
        ("poddisruptionbudgets", "watch"),
        ("events", "create"),
    }


def test_the_extender_answers_only_the_scheduler() -> None:
    """Mutual TLS in the Deployment and in both shipped scheduler configs; the NetworkPolicy is not a file of
    deploy/ (its addresses are the cluster's own) but made for the cluster by scripts/extender-networkpolicy."""
    kinds = {d["kind"]: d for d in documents("extender.yaml")}
    (container,) = kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
    flags = dict(arg.split("=", 1) for arg in container["args"] if "=" in arg)
    assert {"--tls-cert", "--tls-key", "--client-ca", "--client-name"} <= flags.keys()
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert "NetworkPolicy" not in kinds
    for name in ("control-plane/scheduler-config.yaml", "control-plane/scheduler-config-v1beta1.yaml"):
        (config,) = documents(name)
        for extender in config["extenders"]:
            assert extender["urlPrefix"].startswith("https://") and extender["enableHTTPS"] is True
            assert set(extender["tlsConfig"]) == {"certFile", "keyFile", "caFile"}


#: The groups of the objects ``kubectl apply -f deploy/`` may meet: the API server's own (core is "v1").
API_GROUPS = {"v1", "apps", "rbac.authorization.k8s.io", "policy", "admissionregistration.k8s.io"}


def test_kubectl_apply_f_deploy_meets_only_api_objects_and_no_placeholder() -> None:
    """``kubectl apply -f deploy/`` reads every .yaml, .yml and .json file at deploy/'s top level: each holds
    only API objects as they are (the kustomization is ``Kustomization``, a name kubectl -f skips and -k
    reads; scheduler configs, the static pod and the samples live in folders of their own), and no file under
    deploy/ but the chart's templates carries an EDIT placeholder."""
    top = sorted(p for p in DEPLOY.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml", ".json"))
    assert [p.name for p in top] == ["admission-policy.yaml", "extender.yaml", "node-rbac.yaml"]
    for path in top:
        for doc in documents(path.name):
            group = doc["apiVersion"].rpartition("/")[0] or doc["apiVersion"]
            assert group in API_GROUPS, (path.name, doc["kind"], doc["apiVersion"])
    placeholders = [
        f"{p.relative_to(DEPLOY)}:{n}"
        for p in sorted(DEPLOY.rglob("*"))
        if p.is_file() and "helm" not in p.parts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bEDIT\b", line)
    ]
    assert placeholders == []


def networkpolicy(*args: str, kubectl: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if kubectl is not None:
        env["PATH"] = f"{kubectl.parent}:{env['PATH']}"
    script = DEPLOY.parent / "scripts" / "extender-networkpolicy"
    return subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=30, check=False
    )


def test_the_networkpolicy_names_the_addresses_given_and_refuses_what_is_not_a_network() -> None:
    done = networkpolicy("--cidr", "10.0.0.11", "--cidr", "10.0.0.10/32", "--cidr", "fd00::/64")
    assert done.returncode == 0, done.stderr
    policy = json.loads(done.stdout)
    assert (policy["kind"], policy["metadata"]) == (
        "NetworkPolicy",
        {"name": "gpushared-extender", "namespace": "kube-system"},
    )
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 39999}]
    assert [s["ipBlock"]["cidr"] for s in rule["from"] if "ipBlock" in s] == [
        "10.0.0.10/32",
        "10.0.0.11/32",
        "fd00::/64",
    ]
    assert {"podSelector": {"matchLabels": {"app": "gpushared-extender"}}} in rule["from"]
    for bad in ("EDIT-control-plane-address/32", "10.0.0.1/33", "10.0.0.1/24", ""):
        refused = networkpolicy("--cidr", bad)
        assert refused.returncode == 2 and "is not a network" in refused.stderr and not refused.stdout, bad


def test_the_networkpolicy_reads_the_control_plane_nodes_addresses(tmp_path: Path) -> None:
    """Without --cidr: one host network per InternalIP of the nodes labelled control-plane (or master), read
    through kubectl; none found (a managed cluster) exits 2 and asks for --cidr."""
    nodes = {
        "items": [
            {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}},
             "status": {"addresses": [{"type": "InternalIP", "address": "192.168.1.10"},
                                      {"type": "Hostname", "address": "cp-1"}]}},
            {"metadata": {"labels": {"node-role.kubernetes.io/master": ""}},
             "status": {"addresses": [{"type": "InternalIP", "address": "192.168.1.11"}]}},
            {"metadata": {"labels": {}}, "status": {"addresses": [{"type": "InternalIP", "address": "192.168.1.50"}]}},
        ]
    }  # fmt: skip
    kubectl = tmp_path / "kubectl"
    listing = tmp_path / "nodes.json"
    listing.write_text(json.dumps(nodes))
    kubectl.write_text(f"#!/bin/sh\ncat {listing}\n")
    kubectl.chmod(0o755)
    done = networkpolicy(kubectl=kubectl)
    assert done.returncode == 0, done.stderr
    sources = json.loads(done.stdout)["spec"]["ingress"][0]["from"]
    assert [s["ipBlock"]["cidr"] for s in sources if "ipBlock" in s] == ["192.168.1.10/32", "192.168.1.11/32"]
    listing.write_text(json.dumps({"items": nodes["items"][2:]}))
    refused = networkpolicy(kubectl=kubectl)
    assert refused.returncode == 2 and "--cidr" in refused.stderr and not refused.stdout


def test_sample_asks_for_gpu_memory() -> None:
    (sample,) = documents("examples/binpack-1.yaml")
    assert sample["metadata"]["name"] == "binpack-1"
    assert sample["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["aliyun.com/gpu-mem"] == 2


def test_the_admission_policies_freeze_the_allocation_keys_and_scope_node_identities() -> None:
    """Kubernetes >= 1.30 (not served by the 1.20 test cluster): checked here for what they name."""
    docs = documents("admission-policy.yaml")
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    bindings = {d["spec"]["policyName"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert (
        set(policies)
        == set(bindings)
        == {
            "gpushared-frozen-allocation",
            "gpushared-tenant-annotations",
            "gpushared-node-inventory",
            "gpushared-node-scope-pods",
            "gpushared-node-scope-nodes",
        }
    )
    assert all(b["spec"]["validationActions"] == ["Deny"] for b in bindings.values())
    frozen = policies["gpushared-frozen-allocation"]["spec"]
    keys = next(v["expression"] for v in frozen["variables"] if v["name"] == "keys")
    named = set(re.findall(r"'([^']+)'", keys))
    assert named == {
        contract.POD_ALLOCATION,
        contract.ALIYUN_GPU_MEM_IDX,
        contract.ALIYUN_GPU_MEM_POD,
        contract.ALIYUN_GPU_MEM_DEV,
        contract.POD_COMPUTE_REQUEST,
        contract.POD_COMPUTE_LIMIT,
    }
    # the daemon's own writes after bind stay allowed
    assert contract.ALIYUN_GPU_MEM_ASSIGNED not in named and contract.ALIYUN_GPU_MEM_ASSUME_TIME not in named
    for name, resources in (("pods", {"pods"}), ("nodes", {"nodes", "nodes/status"})):
        scope = policies[f"gpushared-node-scope-{name}"]["spec"]
        assert "gpushared-node-" in scope["matchConditions"][0]["expression"]
        assert {r for rule in scope["matchConstraints"]["resourceRules"] for r in rule["resources"]} == resources


def images(docs: list[dict[str, Any]]) -> list[str]:
    found = []
    for doc in docs:
        pod = doc["spec"]["template"]["spec"] if doc["kind"] in ("Deployment", "DaemonSet") else doc.get("spec", {})
        found += [c["image"] for c in pod.get("containers", []) if isinstance(pod, dict)]
    return found


def test_every_manifest_runs_this_release_of_the_extender_image() -> None:
    """A manifest of release X runs image X: the tag moves with gpushared.__version__ (and the
    kustomization that lets an operator point at a registry carries the same tag)."""
    ours = [
        image
        for name in ("extender.yaml", "control-plane/extender-static-pod.yaml")
        for image in images(documents(name))
        if "gpushared-extender" in image
    ]
    assert ours == [f"localhost/gpushared-extender:{__version__}"] * 2
    (kustomization,) = documents("Kustomization")
    (image,) = kustomization["images"]
    assert (image["name"], image["newTag"]) == ("localhost/gpushared-extender", __version__)
    assert set(kustomization["resources"]) <= {p.name for p in DEPLOY.iterdir()}


def test_the_extender_runs_beside_kube_scheduler() -> None:
    """The Deployment on control-plane nodes; the static pod on the host network, reached over loopback,
    as the shipped scheduler configs call it."""
    (deployment,) = [d for d in documents("extender.yaml") if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"node-role.kubernetes.io/control-plane": ""}
    assert {t["key"] for t in spec["tolerations"]} == {
        "node-role.kubernetes.io/control-plane",
        "node-role.kubernetes.io/master",
    }
    (static,) = documents("control-plane/extender-static-pod.yaml")
    assert static["kind"] == "Pod" and static["spec"]["hostNetwork"] is True
    (container,) = static["spec"]["containers"]
    flags = dict(arg.split("=", 1) for arg in container["args"] if "=" in arg)
    assert flags["--port"] == "39999"
    files = ("--tls-cert", "--tls-key", "--client-ca", "--kubeconfig")
    assert all(flags[k].startswith("/etc/kubernetes/gpushared/") for k in files)
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for name in ("control-plane/scheduler-config.yaml", "control-plane/scheduler-config-v1beta1.yaml"):
        for extender in documents(name)[0]["extenders"]:
            assert extender["urlPrefix"] == "https://127.0.0.1:39999/gpushare-scheduler"


def test_the_second_scheduler_is_wired_to_the_extender_and_the_webhook_never_blocks() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in documents("managed/gpushared-scheduler.yaml")}
    config = yaml.safe_load(docs["ConfigMap", "gpushared-scheduler"]["data"]["config.yaml"])
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert [p["schedulerName"] for p in config["profiles"]] == ["gpushared-scheduler"]
    election = config["leaderElection"]
    assert (election["leaderElect"], election["resourceName"], election["resourceLock"]) == (
        True,
        "gpushared-scheduler",
        "leases",
    )
    # The same extender entry as the control plane's config, through the Service (it runs in a pod).
    (extender,) = config["extenders"]
    (shipped,) = documents("control-plane/scheduler-config.yaml")[0]["extenders"]
    assert {k: v for k, v in extender.items() if k != "urlPrefix"} == {
        k: v for k, v in shipped.items() if k != "urlPrefix"
    }
    assert extender["urlPrefix"] == "https://gpushared-extender.kube-system.svc:39999/gpushare-scheduler"
    # Its own Lease, and only that one, beyond the built-in scheduler roles.
    lease = docs["Role", "gpushared-scheduler-lease"]["rules"]
    assert [r.get("resourceNames") for r in lease] == [None, ["gpushared-scheduler"]]
    assert {docs["ClusterRoleBinding", n]["roleRef"]["name"] for n in (
        "gpushared-scheduler-as-kube-scheduler", "gpushared-scheduler-as-volume-scheduler")} == {
        "system:kube-scheduler", "system:volume-scheduler"}  # fmt: skip
    (webhook,) = docs["MutatingWebhookConfiguration", "gpushared-scheduler"]["webhooks"]
    assert webhook["failurePolicy"] == "Ignore" and webhook["sideEffects"] == "None"
    assert webhook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert webhook["clientConfig"]["service"]["path"] == "/gpushare-scheduler/mutate"
    assert "caBundle" not in webhook["clientConfig"]  # written by scripts/extender-certs, kept on re-apply
    assert {e["key"] for e in webhook["namespaceSelector"]["matchExpressions"]} == {
        "gpushared.io/scheduler",
        "kubernetes.io/metadata.name",
    }
    # The extender's NetworkPolicy lets this scheduler in.
    sources = json.loads(networkpolicy("--cidr", "10.0.0.10").stdout)["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app": "gpushared-scheduler"}}} in sources
