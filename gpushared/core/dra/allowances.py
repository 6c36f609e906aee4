"""What each container of a DRA pod may use of the GPUs its claims were prepared on: the memory watcher's
allowances for pods served by the DRA driver. The containers that share a claim share
its memory (``core.dra.claimusers``). Pure."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping

from gpushared import contract
from gpushared.core.dra.claimusers import ClaimUse, claim_users, container_claims, sharers, uses_request
from gpushared.core.dra.companions import DriverClaim, companions
from gpushared.core.dra.prepare import PreparedClaim
from gpushared.core.node.memory import Allowance, Enforcement, pod_enforcement
from gpushared.core.shared.bodies import PodBody, annotations_of, uid_of


def claim_allowances(
    pod: PodBody,
    claims: Mapping[tuple[str, str], PreparedClaim],
    *,
    node: Enforcement,
    users: Counter[ClaimUse] | None = None,
) -> dict[tuple[str, str], Allowance]:
    """What each container of a DRA pod may use, from the claims prepared on the node (``claims``: by
    namespace and name). A container names the pod's claims it uses (``resources.claims``, optionally one
    request of each); the pod maps each to a ResourceClaim (``core.dra.claimusers``). The containers that share
    a claim share its memory: each may use its part, the claim's memory on each GPU over the containers
    that use it, counted when it was prepared or now among ``users`` (the containers of the node's pods),
    whichever is more (a pod that joins a claim later is never prepared again)."""
    uid = uid_of(pod)
    enforcement = pod_enforcement(node, annotations_of(pod).get(contract.POD_MEMORY_ENFORCEMENT))
    counted = users if users is not None else claim_users([pod])
    allowances: dict[tuple[str, str], Allowance] = {}
    for container, _, uses in container_claims(pod):
        allocated: dict[int, int] = defaultdict(int)
        mps = False
        for use in uses:
            claim = claims.get(use[:2])
            if claim is None:
                continue
            for device in claim.devices:
                if not uses_request(use, device.request):
                    continue
                parts = max(device.sharers, sharers(counted, use[0], use[1], device.request))
                allocated[device.index] += device.memory_mib // parts
                mps = mps or device.mps
        if allocated:
            allowances[(uid, str(container.get("name", "")))] = Allowance(dict(allocated), enforcement, mps)
    return allowances


def combination_problem(pod: PodBody, claims: Mapping[tuple[str, str], PreparedClaim]) -> str | None:
    """Why a running container of ``pod`` may be told other GPUs than its claims hold (some it holds no claim
    to, or only some of its own), or None. The kubelet prepares a claim once per node: a pod reserved after
    it was prepared, with no claim of its own left to prepare, is never seen by the driver, and a container
    of it that combines the claims otherwise than their CDI specs were written for (``core.dra.companions``)
    is told what the last device applied says. Only for a running pod, whose claims are all prepared (while
    it starts, a claim not yet in ``claims`` would look like another driver's)."""
    if (pod.get("status") or {}).get("phase") != "Running":
        return None
    known = {
        key: DriverClaim(
            claim.ref,
            tuple(dict.fromkeys(d.request for d in claim.devices)),
            {cdi.name: cdi.combination for cdi in claim.cdi},
        )
        for key, claim in claims.items()
    }
    return companions([pod], known).problems.get(uid_of(pod))
