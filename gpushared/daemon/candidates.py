"""The pods an Allocate call may be for, gathered from the kubelet and the API server.

``core.node.handshake`` decides which container is asking; this gathers what it decides over: the kubelet's
PodResources listing (which pods are in its pod manager, and which containers have devices), the pod
bodies from the node's pod watch, and — only for a pod the watch has not delivered yet — one read of
that pod by name, within what is left of the call's budget. See docs/design.md §7.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

from gpushared import contract
from gpushared.contract import MemoryUnit, ResourceNames
from gpushared.core.node import handshake
from gpushared.core.shared.bodies import PodBody, node_of, uid_of
from gpushared.core.shared.requests import pod_request
from gpushared.kube.api import Api, KubeError, NotFound
from gpushared.kube.podwatch import PodWatch
from gpushared.kubelet.deviceplugin.server import AllocationRefused
from gpushared.kubelet.podresources.client import PodDevices, PodResourcesUnavailable, list_pod_devices

log = logging.getLogger(__name__)

#: What one GetPreferredAllocation or Allocate may spend on the API server, all reads together. The kubelet
#: admits pods one at a time: a hung API server once held every admission on the node for 40 s (10 s x
#: urllib3's retries). Past it the kubelet gets UNAVAILABLE, and tries the pod again.
ALLOCATE_BUDGET_SECONDS = 2.0
#: Tries of the handshake when it may be waiting on the kubelet or the watch (a rejected pod's status,
#: a just-bound pod's watch event), RETRY_SECONDS apart.
ATTEMPTS = 3
RETRY_SECONDS = 0.1


class Candidates:
    def __init__(
        self,
        *,
        node: str,
        unit: MemoryUnit,
        resources: ResourceNames,
        api: Api | None,
        pods: PodWatch | None,
        pod_resources_socket: Path,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.node = node
        self.sleep = sleep
        self.unit = unit
        self.resources = resources
        #: the reads on the kubelet's path: tried once, within what is left of ALLOCATE_BUDGET_SECONDS
        self._lookup = api.without_retries() if api is not None else None
        self.pods = pods
        self.pod_resources_socket = pod_resources_socket
        self.gpu_free: set[str] = set()  # UIDs of pods that ask for no GPU memory

    def identify(self, size: int, *, served: Callable[[str], Collection[str]], deadline: float) -> handshake.Decision:
        """The container asking for ``size`` units; API reads end by ``deadline`` (time.monotonic).
        ``served(uid)`` names the containers of a pod this daemon answered Allocate for. Raises
        :class:`handshake.Unidentified` when no single container can be named."""
        for attempt in range(ATTEMPTS):
            try:
                return handshake.identify(size, self._gather(deadline, served), unit=self.unit, node=self.node)
            except handshake.Unidentified as exc:
                if not exc.retry or attempt == ATTEMPTS - 1:
                    raise
                self.sleep(RETRY_SECONDS)
        raise AssertionError("unreachable")

    def _gather(self, deadline: float, served: Callable[[str], Collection[str]]) -> list[handshake.Candidate]:
        try:
            listing: list[PodDevices] | None = list_pod_devices(
                self.pod_resources_socket, resource=self.resources.gpu_mem
            )
        except PodResourcesUnavailable as exc:
            log.warning("kubelet PodResources unavailable (%s): matching by annotations alone", exc)
            listing = None
        found = []
        if listing is None:
            for pod in self.pods.pods() if self.pods is not None else []:
                option = self._candidate(pod, listed=None, served=served)
                if option is not None and option.slots is not None:
                    found.append(option)
            return found
        for entry in listing:
            if entry.containers and all(entry.containers.values()):
                continue  # every app container has its devices: admitted long ago
            body = self._pod(entry.namespace, entry.name, listed=entry.containers, deadline=deadline)
            if body is None or uid_of(body) in self.gpu_free:
                continue
            option = self._candidate(body, listed=entry.containers, served=served)
            if option is not None:
                found.append(option)
            elif not _asks_gpu_memory(body, self.resources):
                self.gpu_free.add(uid_of(body))  # a pod's spec never changes: never look at it again
        return found

    def _candidate(
        self, pod: PodBody, *, listed: dict[str, list[str]] | None, served: Callable[[str], Collection[str]]
    ) -> handshake.Candidate | None:
        return handshake.candidate(
            pod, listed=listed, served=set(served(uid_of(pod))), unit=self.unit, resources=self.resources
        )

    def _pod(self, namespace: str, name: str, *, listed: dict[str, list[str]], deadline: float) -> PodBody | None:
        """The pod's body from the watch; fetched (one pod, by name) only when it may be the one admitted."""
        pod = self.pods.find(namespace, name) if self.pods is not None else None
        if pod is not None or self._lookup is None:
            return pod
        if listed and all(listed.values()):
            return None  # every app container has devices: not being admitted
        left = deadline - time.monotonic()
        if left <= 0.05:
            raise AllocationRefused(
                f"cannot read pod {namespace}/{name} to find its GPU: the API server took the "
                f"{ALLOCATE_BUDGET_SECONDS:.0f} s an admission may wait",
                retryable=True,
            )
        try:
            pod = self._lookup.get_pod(namespace, name, timeout=left)
        except NotFound:
            return None
        except KubeError as exc:
            raise AllocationRefused(
                f"cannot read pod {namespace}/{name} to find its GPU: {exc}", retryable=True
            ) from exc
        if node_of(pod) != self.node:
            return None
        if self.pods is not None:
            self.pods.remember(pod)
        return pod

    def forget(self, present: Collection[str]) -> None:
        """Keep only what is known of the pods with these UIDs."""
        self.gpu_free &= set(present)


def _asks_gpu_memory(pod: PodBody, resources: ResourceNames) -> bool:
    try:
        return pod_request(pod, resources=resources).total > 0
    except contract.ContractError:
        return True
