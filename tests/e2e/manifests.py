"""deploy/'s control-plane manifests as the local cluster runs them: each edit here is one the local
cluster forces, and says why. Everything else, RBAC, arguments, configuration, probes, security context,
is applied as shipped.

What the local cluster lacks: kube-proxy (a Service's ClusterIP leads nowhere), cluster DNS, a registry
(images are imported), and a second node (so one replica of what binds a host port), and its ports are
chosen at random so that it runs beside anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.e2e import versions
from tests.e2e.versions import Version

ROOT = Path(__file__).resolve().parents[2]
STATIC_EXTENDER = ROOT / "deploy" / "extender-static-pod.yaml"
SECOND_SCHEDULER = ROOT / "deploy" / "gpushared-scheduler.yaml"


def static_extender(*, certs: Path, port: int) -> dict[str, Any]:
    """deploy/extender-static-pod.yaml with ``certs`` as /etc/kubernetes/gpushared and this cluster's port."""
    pod: dict[str, Any] = yaml.safe_load(STATIC_EXTENDER.read_text())
    (volume,) = [v for v in pod["spec"]["volumes"] if "hostPath" in v]
    volume["hostPath"]["path"] = str(certs)  # the guide's /etc/kubernetes/gpushared, in the test's directory
    (container,) = pod["spec"]["containers"]
    container["args"] = [f"--port={port}" if arg.startswith("--port=") else arg for arg in container["args"]]
    for probe in ("readinessProbe", "livenessProbe"):
        container[probe]["httpGet"]["port"] = port
    return pod


def second_scheduler(
    *, version: Version, image: str, extender_url: str, apiserver_port: int, secure_port: int, health_port: int
) -> list[dict[str, Any]]:
    """deploy/gpushared-scheduler.yaml for this cluster.

    - the scheduler's configuration in the API version ``version`` serves (v1beta1 on 1.20; v1 as shipped
      from 1.25), calling the extender at ``extender_url``: its Service has no ClusterIP route here;
    - the Deployment on the host network, one replica (one node, one port), reaching the API server at
      127.0.0.1 (the in-cluster address is a ClusterIP too), with ``image`` (imported, not pulled);
    - the webhook called at a URL on 127.0.0.1 instead of through the Service, for the same reason;
    - the PodDisruptionBudget in the policy API ``version`` serves (policy/v1 as shipped from 1.21).
    """
    docs = [d for d in yaml.safe_load_all(SECOND_SCHEDULER.read_text()) if d]
    chosen = versions.scheduler_api(version)
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            config = yaml.safe_load(doc["data"]["config.yaml"])
            config["apiVersion"] = chosen.api_version
            if chosen.bind_addresses:
                config["healthzBindAddress"] = config["metricsBindAddress"] = f"127.0.0.1:{health_port}"
            for extender in config["extenders"]:
                extender["urlPrefix"] = f"{extender_url}/gpushare-scheduler"
            doc["data"]["config.yaml"] = yaml.safe_dump(config)
        elif doc["kind"] == "Deployment":
            doc["spec"]["replicas"] = 1
            pod = doc["spec"]["template"]["spec"]
            pod["hostNetwork"] = True
            (container,) = pod["containers"]
            container["image"] = image
            container["command"] += [
                f"--secure-port={secure_port}",
                "--bind-address=127.0.0.1",
                *versions.insecure_port_flags(version),
            ]
            container["env"] = [
                {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(apiserver_port)},
            ]
            for probe in ("readinessProbe", "livenessProbe"):
                container[probe]["httpGet"].update(host="127.0.0.1", port=secure_port)
        elif doc["kind"] == "PodDisruptionBudget":
            doc["apiVersion"] = versions.pdb_api(version)
        elif doc["kind"] == "MutatingWebhookConfiguration":
            for webhook in doc["webhooks"]:
                path = webhook["clientConfig"]["service"]["path"]
                webhook["clientConfig"] = {"url": extender_url + path}
    return docs
