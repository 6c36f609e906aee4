"""The DRA calls (``resource.k8s.io/v1``, Kubernetes >= 1.34) the node daemon makes in DRA mode: its own
node's ResourceSlices, and the ResourceClaims the kubelet asks it to prepare. Dicts in, dicts out."""

from __future__ import annotations

import contextlib
from typing import Any

from gpushared.contract import dra
from gpushared.kube.errors import NotFound
from gpushared.kube.rest import Rest, quoted

PREFIX = f"/apis/{dra.API_GROUP}/{dra.API_VERSION}"


class ResourceApi:
    def __init__(self, rest: Rest) -> None:
        self.rest = rest

    def served(self) -> bool:
        """Whether the API server serves ``resource.k8s.io/v1`` (1.34 and later; earlier ones answer 404)."""
        try:
            self.rest.request("discover resource.k8s.io/v1", "GET", PREFIX)
        except NotFound:
            return False
        return True

    def list_slices(self, *, node: str, driver: str) -> list[dict[str, Any]]:
        """The node's slices of ``driver`` (field selectors: the server filters, and a node may see only its own)."""
        query = {"fieldSelector": f"spec.nodeName={node},spec.driver={driver}"}
        answer = self.rest.request(
            f"list ResourceSlices of node {node}", "GET", f"{PREFIX}/resourceslices", query=query
        )
        return list(answer.get("items") or [])

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        answer: dict[str, Any] = self.rest.request(
            f"create ResourceSlice {name}", "POST", f"{PREFIX}/resourceslices", body=body
        )
        return answer

    def replace_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """PUT; ``metadata.resourceVersion`` in ``body`` makes it conditional (409 when stale)."""
        name = body["metadata"]["name"]
        path = f"{PREFIX}/resourceslices/{quoted(name)}"
        answer: dict[str, Any] = self.rest.request(f"update ResourceSlice {name}", "PUT", path, body=body)
        return answer

    def delete_slice(self, name: str) -> None:
        with contextlib.suppress(NotFound):
            self.rest.request(f"delete ResourceSlice {name}", "DELETE", f"{PREFIX}/resourceslices/{quoted(name)}")

    def list_claims(self) -> list[dict[str, Any]]:
        """Every ResourceClaim of the cluster (the inspect tool's view of DRA nodes)."""
        answer = self.rest.request("list ResourceClaims", "GET", f"{PREFIX}/resourceclaims")
        return list(answer.get("items") or [])

    def get_claim(self, namespace: str, name: str, *, timeout: float) -> dict[str, Any]:
        path = f"{PREFIX}/namespaces/{quoted(namespace)}/resourceclaims/{quoted(name)}"
        answer: dict[str, Any] = self.rest.request(
            f"get ResourceClaim {namespace}/{name}", "GET", path, timeout=timeout
        )
        return answer
