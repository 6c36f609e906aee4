"""Which containers use a DRA claim, and so how many share its memory.

Every container that names a claim gets the same CDI device from the runtime, so on its own each would be
given all of the claim's memory: two containers of a 2 GiB claim each got ``ALIYUN_COM_GPU_MEM_CONTAINER=2``,
and under MPS each was capped at 2 GiB, 4 GiB between them. The containers of one claim share it: the
driver splits each request's memory evenly among the containers that use it when it prepares the claim
(``core.dra.prepare``), and the memory watcher holds each to its part (``core.dra.allowances.claim_allowances``).

Counted: a pod's app containers and its sidecars (init containers that keep running), which run at once;
an init container that runs to completion runs before them, alone, and is held to the same part. A
container names the pod's claim (``resources.claims[].name``) and optionally one request of it; the pod
maps its claim names to ResourceClaims (``spec.resourceClaims``, and for a template the claim made for it,
``status.resourceClaimStatuses``). Pure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from gpushared.core.shared.bodies import PodBody, key_of

#: (namespace, ResourceClaim name, request or None for every request of the claim)
ClaimUse = tuple[str, str, str | None]


def pod_claim_names(pod: PodBody) -> dict[str, str]:
    """The pod's names for its claims -> the ResourceClaims' names (templates' once they are made)."""
    spec: Any = pod.get("spec") or {}
    status: Any = pod.get("status") or {}
    names: dict[str, str] = {}
    for entry in [*(spec.get("resourceClaims") or []), *(status.get("resourceClaimStatuses") or [])]:
        if isinstance(entry, dict) and isinstance(entry.get("resourceClaimName"), str):
            names[str(entry.get("name"))] = entry["resourceClaimName"]
    return names


def container_claims(pod: PodBody) -> Iterator[tuple[dict[str, Any], bool, list[ClaimUse]]]:
    """Each container with whether it runs beside the others (an app container or a sidecar) and the
    claims it uses."""
    spec: Any = pod.get("spec") or {}
    namespace = key_of(pod)[0]
    names = pod_claim_names(pod)
    containers = [
        (c, c.get("restartPolicy") == "Always") for c in spec.get("initContainers") or [] if isinstance(c, dict)
    ]
    containers += [(c, True) for c in spec.get("containers") or [] if isinstance(c, dict)]
    for container, concurrent in containers:
        uses: list[ClaimUse] = []
        for ref in (container.get("resources") or {}).get("claims") or []:
            if not isinstance(ref, dict):
                continue
            claim = names.get(str(ref.get("name")))
            if claim is None:
                continue
            request = ref.get("request")
            uses.append((namespace, claim, request if isinstance(request, str) and request else None))
        yield container, concurrent, uses


def claim_users(pods: Iterable[PodBody]) -> Counter[ClaimUse]:
    """The containers of ``pods`` that run at once, counted per claim (and request) they use."""
    counted: Counter[ClaimUse] = Counter()
    for pod in pods:
        for _, concurrent, uses in container_claims(pod):
            if concurrent:
                counted.update(set(uses))
    return counted


def sharers(users: Counter[ClaimUse], namespace: str, claim: str, request: str) -> int:
    """How many containers share request ``request`` of the claim (a subrequest ``a/b`` is request ``a`` to a
    container): those that name that request and those that name the claim whole; at least one."""
    base = request.split("/", 1)[0]
    return max(1, users[(namespace, claim, None)] + users[(namespace, claim, base)])


def uses_request(use: ClaimUse, request: str) -> bool:
    """Whether a container's use of a claim covers the claim's ``request``."""
    return use[2] is None or use[2] in (request, request.split("/", 1)[0])
