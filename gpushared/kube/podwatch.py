"""The pods bound to one node, mirrored by an informer scoped with ``spec.nodeName``.

Scoping matters: Aliyun's device plugin listed every pod in the cluster on each Allocate and overloaded
API servers. One list and one watch per node cost the API server almost nothing.
"""

from __future__ import annotations

from gpushared.core.shared.bodies import PodBody, node_of
from gpushared.kube.api import Api
from gpushared.kube.informer import Informer


class PodWatch(Informer[PodBody]):
    def __init__(self, api: Api, node: str, *, watch_seconds: int = 300) -> None:
        super().__init__(
            api.rest.lister("/api/v1/pods", what=f"pods on node {node}"),
            name=f"pods on node {node}",
            field_selector=f"spec.nodeName={node}",
            watch_seconds=watch_seconds,
        )
        self.node = node

    def pods(self) -> list[PodBody]:
        return self.objects()

    def find(self, namespace: str, name: str) -> PodBody | None:
        return self.get(namespace, name)

    def remember(self, obj: PodBody) -> None:
        if node_of(obj) == self.node:
            super().remember(obj)
