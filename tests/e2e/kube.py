"""What the end-to-end tests ask of the real cluster, through the real ``kubernetes`` client.

Pods come back as plain dicts (the API's own JSON), so the tests read them with the same core functions the
extender and the daemon use.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpushared import contract
from gpushared.contract import GpuInventory
from tests.e2e.cluster import NODE, LocalCluster, wait_for
from tests.e2e.versions import creates_token_secrets, serves_dra

GPU_MEM = contract.DEFAULT_RESOURCES.gpu_mem
#: Prints the GPU env Allocate gave the container, then waits, leaving at once on SIGTERM (as PID 1 it would
#: otherwise ignore it and every deletion would take the whole grace period).
#: DEVICES= lists the NVIDIA device files the container has (deviceNodes).
PRINT_ENV = (
    "env | grep -E '^(NVIDIA|ALIYUN|CUDA|GPUSHARED)' | sort; "
    "echo DEVICES=$(ls /dev | grep '^nvidia' | sort | tr '\\n' ' '); "
    "echo READY; trap 'exit 0' TERM; sleep 3600 & wait"
)


def gpu_pod(name: str, *amounts: int, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """One container per amount (GiB of gpu-mem; 0: none), each printing its GPU env."""
    containers = []
    for i, amount in enumerate(amounts):
        container: dict[str, Any] = {
            "name": name if len(amounts) == 1 else f"c{i}",
            "image": "busybox",
            "imagePullPolicy": "IfNotPresent",
            "command": ["sh", "-c", PRINT_ENV],
        }
        if amount:
            container["resources"] = {"limits": {GPU_MEM: str(amount)}}
        containers.append(container)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 2},
    }


@dataclass
class Kube:
    core: client.CoreV1Api
    cluster: LocalCluster

    # --- namespaces ---------------------------------------------------------------------------------------

    def create_namespace(self, name: str) -> None:
        self.core.create_namespace({"metadata": {"name": name}})

        token_secrets = creates_token_secrets(self.cluster.version("kube-controller-manager"))

        def token_ready() -> bool:
            # Pod admission wants the default ServiceAccount and, before 1.24, its token Secret.
            try:
                account = self.core.read_namespaced_service_account("default", name)
            except ApiException:
                return False
            return bool(account.secrets) or not token_secrets

        wait_for(token_ready, timeout=30, what=f"the default ServiceAccount token in {name}")

    def delete_namespace(self, name: str) -> None:
        """Delete the namespace once its pods are gone (their containers stopped: GPU memory free again).

        Waiting for the pods ourselves is much faster than waiting for the namespace controller's backoff."""
        self.cluster.kubectl("-n", name, "delete", "deployments,replicasets", "--all", "--wait=false")
        self.cluster.kubectl("-n", name, "delete", "pods", "--all", "--grace-period=2", "--wait=false")
        wait_for(lambda: not self.pods(name), timeout=120, what=f"the pods of {name} to be deleted", interval=0.5)
        if serves_dra(self.cluster.version()):
            # A namespace's claims outlive its pods until the namespace controller deletes them, holding their
            # GPUs' room meanwhile: gone now, the next case starts with the GPUs free.
            self.cluster.kubectl("-n", name, "delete", "resourceclaims", "--all", "--timeout=50s", check=False)
        self.core.delete_namespace(name)

    # --- pods ---------------------------------------------------------------------------------------------

    def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._json(self.core.create_namespaced_pod(namespace, body, _preload_content=False))

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self._json(self.core.read_namespaced_pod(name, namespace, _preload_content=False))

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        response = self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        return list(self._json(response)["items"])

    def all_pods(self) -> list[dict[str, Any]]:
        return list(self._json(self.core.list_pod_for_all_namespaces(_preload_content=False))["items"])

    @staticmethod
    def _json(response: Any) -> Any:
        return json.loads(response.data)

    def wait_running(self, namespace: str, *names: str, timeout: float = 90) -> list[dict[str, Any]]:
        def running() -> list[dict[str, Any]] | None:
            pods = [self.pod(namespace, name) for name in names]
            return pods if all(p["status"].get("phase") == "Running" for p in pods) else None

        try:
            return wait_for(running, timeout=timeout, what=f"pods {', '.join(names)} Running")  # type: ignore[no-any-return]
        except Exception as error:
            states = {name: self.describe(namespace, name) for name in names}
            raise AssertionError(f"{error}: {json.dumps(states, indent=1)}") from None

    def describe(self, namespace: str, name: str) -> dict[str, Any]:
        """What a person would look at when a pod is stuck: phase, conditions, container states, events."""
        pod = self.pod(namespace, name)
        return {
            "phase": pod["status"].get("phase"),
            "node": pod["spec"].get("nodeName"),
            "conditions": pod["status"].get("conditions"),
            "containers": [s.get("state") for s in pod["status"].get("containerStatuses", [])],
            "events": self.events(namespace, name),
        }

    def logs(self, namespace: str, name: str, container: str | None = None) -> str:
        kwargs = {"container": container} if container else {}
        return str(self.core.read_namespaced_pod_log(name, namespace, **kwargs))

    def env_of(self, namespace: str, name: str, container: str | None = None) -> dict[str, str]:
        """The GPU env the container printed at start, read through the API server's log endpoint."""

        def printed() -> str | None:
            text = self.logs(namespace, name, container)
            return text if "READY" in text else None

        text = wait_for(printed, timeout=30, what=f"{name}/{container or name} to print its env")
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def events(self, namespace: str, name: str) -> list[tuple[str, str]]:
        events = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
        return [(e.reason, e.message) for e in events.items]

    def wait_event(self, namespace: str, name: str, match: Callable[[str, str], bool], timeout: float = 60) -> str:
        found = wait_for(
            lambda: next((m for r, m in self.events(namespace, name) if match(r, m)), None),
            timeout=timeout,
            what=f"an event on {name}",
            interval=0.5,
        )
        return str(found)

    # --- the node -----------------------------------------------------------------------------------------

    def node(self) -> dict[str, Any]:
        return self._json(self.core.read_node(NODE, _preload_content=False))  # type: ignore[no-any-return]

    def inventory(self) -> GpuInventory:
        return contract.parse_inventory(self.node()["metadata"]["annotations"][contract.NODE_INVENTORY])

    def allocatable(self) -> int:
        return int(self.node()["status"].get("allocatable", {}).get(GPU_MEM, "0"))
