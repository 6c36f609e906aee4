"""deploy/'s control-plane manifests as the local cluster runs them: each edit here is one the local
cluster forces, and says why. Everything else, RBAC, arguments, configuration, probes, security context,
is applied as shipped.

What the local cluster lacks: kube-proxy (a Service's ClusterIP leads nowhere), cluster DNS, a registry
(images are imported), and a second node (so one replica of what binds a host port), and its ports are
chosen at random so that it runs beside anything.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.e2e import versions
from tests.e2e.versions import Version

ROOT = Path(__file__).resolve().parents[2]
STATIC_EXTENDER = ROOT / "deploy" / "control-plane" / "extender-static-pod.yaml"
SECOND_SCHEDULER = ROOT / "deploy" / "managed" / "gpushared-scheduler.yaml"


def static_extender(*, certs: Path, port: int) -> dict[str, Any]:
    """deploy/control-plane/extender-static-pod.yaml with ``certs`` as /etc/kubernetes/gpushared and this
    cluster's port."""
    pod: dict[str, Any] = yaml.safe_load(STATIC_EXTENDER.read_text())
    (volume,) = [v for v in pod["spec"]["volumes"] if "hostPath" in v]
    volume["hostPath"]["path"] = str(certs)  # the guide's /etc/kubernetes/gpushared, in the test's directory
    (container,) = pod["spec"]["containers"]
    container["args"] = [f"--port={port}" if arg.startswith("--port=") else arg for arg in container["args"]]
    for probe in ("readinessProbe", "livenessProbe"):
        container[probe]["httpGet"]["port"] = port
    return pod


@dataclass(frozen=True)
class Wiring:
    """What this cluster forces on the control-plane manifests: where the extender and the API server are
    reached (127.0.0.1: no kube-proxy routes a ClusterIP), and the ports the second scheduler serves on
    (host network, chosen at random)."""

    version: Version
    extender_url: str
    apiserver_port: int
    secure_port: int
    health_port: int

    @property
    def apiserver_env(self) -> list[dict[str, str]]:
        """In-cluster clients find the API server here instead of at its ClusterIP."""
        return [
            {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.apiserver_port)},
        ]


def second_scheduler(*, image: str, wiring: Wiring) -> list[dict[str, Any]]:
    """deploy/managed/gpushared-scheduler.yaml for this cluster: the edits of :func:`local_scheduler`, the
    scheduler's configuration in the API version the cluster serves (v1beta1 on 1.20; v1 as shipped from
    1.25), one replica (one node, one host port) and ``image`` (imported, not pulled)."""
    docs = [d for d in yaml.safe_load_all(SECOND_SCHEDULER.read_text()) if d]
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            config = yaml.safe_load(doc["data"]["config.yaml"])
            config["apiVersion"] = versions.scheduler_api(wiring.version).api_version
            doc["data"]["config.yaml"] = yaml.safe_dump(config)
        elif doc["kind"] == "Deployment":
            doc["spec"]["replicas"] = 1
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            container["image"] = image
        local_scheduler(doc, wiring)
    return docs


def one_at_a_time(deployment: dict[str, Any]) -> None:
    """On the host network of one node, a new pod cannot start beside the old one (the same host port):
    a rollout here replaces the pod instead of surging (where there are nodes enough, surging is fine)."""
    deployment["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def local_scheduler(doc: dict[str, Any], wiring: Wiring) -> None:
    """One document of the second scheduler's, in place, as this cluster forces it:

    - its configuration calling the extender at ``extender_url`` (its Service has no ClusterIP route here),
      with 1.20's health and metrics addresses on a free port;
    - the Deployment on the host network, reaching the API server at 127.0.0.1, serving on a free port,
      rolled out one pod at a time;
    - the webhook called at a URL on 127.0.0.1 instead of through the Service, for the same reason;
    - the PodDisruptionBudget in the policy API the version serves (policy/v1 as shipped from 1.21).
    """
    kind = doc["kind"]
    if kind == "ConfigMap" and doc["metadata"]["name"] == "gpushared-scheduler":
        config = yaml.safe_load(doc["data"]["config.yaml"])
        if versions.scheduler_api(wiring.version).bind_addresses:
            config["healthzBindAddress"] = config["metricsBindAddress"] = f"127.0.0.1:{wiring.health_port}"
        for extender in config["extenders"]:
            extender["urlPrefix"] = f"{wiring.extender_url}/gpushare-scheduler"
        doc["data"]["config.yaml"] = yaml.safe_dump(config)
    elif kind == "Deployment" and doc["metadata"]["name"] == "gpushared-scheduler":
        one_at_a_time(doc)
        pod = doc["spec"]["template"]["spec"]
        pod["hostNetwork"] = True
        (container,) = pod["containers"]
        container["command"] += [
            f"--secure-port={wiring.secure_port}",
            "--bind-address=127.0.0.1",
            *versions.insecure_port_flags(wiring.version),
        ]
        container["env"] = wiring.apiserver_env
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            container[probe]["httpGet"].update(host="127.0.0.1", port=wiring.secure_port)
    elif kind == "PodDisruptionBudget":
        doc["apiVersion"] = versions.pdb_api(wiring.version)
    elif kind == "MutatingWebhookConfiguration":
        for webhook in doc["webhooks"]:
            client = webhook["clientConfig"]
            client["url"] = wiring.extender_url + client.pop("service")["path"]


def local_chart(docs: list[dict[str, Any]], wiring: Wiring, *, extender_port: int) -> list[dict[str, Any]]:
    """What deploy/helm/gpushared renders, as this cluster forces it (tests/e2e/helm_post_render.py):
    the second scheduler as :func:`local_scheduler` edits it, the extender on the host network at
    ``extender_port`` (what the scheduler and the webhook call), reaching the API server at 127.0.0.1,
    rolled out one pod at a time, and the node DaemonSet on the host network, reaching it there too.
    The chart's own choices (API versions, images, certificates) are left as rendered."""
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "gpushared-extender":
            one_at_a_time(doc)
            pod = doc["spec"]["template"]["spec"]
            pod["hostNetwork"] = True
            (container,) = pod["containers"]
            container["args"] = [
                f"--port={extender_port}" if arg.startswith("--port=") else arg for arg in container["args"]
            ]
            (port,) = container["ports"]
            port["containerPort"] = extender_port
            container["env"] = [*container.get("env", []), *wiring.apiserver_env]
        elif doc["kind"] == "DaemonSet" and doc["metadata"]["name"] == "gpushared-node":
            # the node daemon: host network (no pod network here), the API server at 127.0.0.1
            pod = doc["spec"]["template"]["spec"]
            pod["hostNetwork"] = True
            (container,) = pod["containers"]
            container["env"] = [*container.get("env", []), *wiring.apiserver_env]
            for probe in ("readinessProbe", "livenessProbe"):
                container[probe]["httpGet"]["host"] = "127.0.0.1"
        elif doc["kind"] == "PodDisruptionBudget":
            pass  # the chart chose the API from the cluster's version: left as rendered
        else:
            local_scheduler(doc, wiring)
    return docs


def at_extender(manifest: Path, *, url: str, ca: bytes) -> list[dict[str, Any]]:
    """A manifest of deploy/ holding a MutatingWebhookConfiguration, its webhooks called at the extender's
    ``url`` (the local cluster has no Service to route to) and trusting the extender's ``ca``."""
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    bundle = base64.b64encode(ca).decode()
    for doc in docs:
        if doc["kind"] == "MutatingWebhookConfiguration":
            for webhook in doc["webhooks"]:
                client = webhook["clientConfig"]
                client["url"] = url + client.pop("service")["path"]
                client["caBundle"] = bundle
    return docs
