"""Which devices the kubelet gave to which pods, read from its PodResources socket."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from gpushared.kubelet.podresources.v1 import api_pb2, api_pb2_grpc


@dataclass(frozen=True)
class PodDevices:
    """One pod in the kubelet's pod manager: container name -> device IDs of one resource. The kubelet lists
    app containers, and since 1.29 (SidecarContainers) restartable init containers too."""

    namespace: str
    name: str
    containers: dict[str, list[str]]


class PodResourcesUnavailable(Exception):
    """The kubelet's PodResources socket did not answer; the message carries the gRPC status."""


def list_pod_devices(socket: Path, *, resource: str, timeout: float = 2.0) -> list[PodDevices]:
    """Raises :class:`PodResourcesUnavailable` when the kubelet does not answer."""
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        raise PodResourcesUnavailable(f"{exc.code()} {exc.details() or ''}".strip()) from exc
    return [
        PodDevices(
            namespace=pod.namespace,
            name=pod.name,
            containers={
                c.name: [i for d in c.devices if d.resource_name == resource for i in d.device_ids]
                for c in pod.containers
            },
        )
        for pod in response.pod_resources
    ]
