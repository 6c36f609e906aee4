"""Who may do what on the fake API server: RBAC as kube-apiserver's authorizer evaluates it, over the Roles,
ClusterRoles and their bindings the store holds, for the requests whose answer depends on it.

Only ServiceAccount tokens the server issued carry an identity (``FakeApiServer.issue_token``); any other
request is taken as an administrator's, as before, so tests that do not apply RBAC are not changed by it. A
test applies the RBAC that gpushared ships (``deploy/``) and authenticates as its ServiceAccount to have
that RBAC checked.

What is checked (each as the real API server checks it):

- from 1.36, a write of a ResourceClaim's status that changes ``status.allocation`` or ``status.reservedFor``
  needs ``update`` (or ``patch``, as the request's verb) on the synthetic subresource ``resourceclaims/binding``
  cluster-wide (KEP-4817, ``DRAResourceClaimGranularStatusAuthorization``, beta and on by default in 1.36):
  without it the write is refused 422 with a ``Forbidden`` field error on ``status.allocation``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from tests.fakes.store import ApiError, Store

#: What kube-apiserver 1.36 answers a status write that changes the allocation without the permission.
BINDING_REFUSED = (
    'changing status.allocation or status.reservedFor requires resource="resourceclaims/binding", '
    'verb="{verb}" permission: {why}'
)


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...]


def user_of(authorization: str, issued: dict[str, float]) -> User | None:
    """The identity of a bearer token this server issued (a ServiceAccount's); None for any other request,
    which the fake takes as an administrator's."""
    token = authorization.removeprefix("Bearer ").strip()
    if token not in issued:
        return None
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return None
    subject = str(claims.get("sub") or "")
    namespace = subject.split(":")[2] if subject.count(":") == 3 else ""
    groups = ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated")
    return User(subject, groups)


def allowed(
    store: Store, user: User, *, verb: str, group: str, resource: str, namespace: str = "", name: str = ""
) -> bool:
    """Whether a RoleBinding in ``namespace`` or a ClusterRoleBinding grants ``user`` the request.
    ``resource`` may carry a subresource (``resourceclaims/binding``)."""
    with store.lock:
        bindings = store.all("clusterrolebindings")
        if namespace:
            bindings += [b for b in store.all("rolebindings") if b["metadata"].get("namespace") == namespace]
        for binding in bindings:
            if not any(_names(subject, user) for subject in binding.get("subjects") or []):
                continue
            ref = binding.get("roleRef") or {}
            role_namespace = "" if ref.get("kind") == "ClusterRole" else binding["metadata"].get("namespace", "")
            plural = "clusterroles" if ref.get("kind") == "ClusterRole" else "roles"
            role = store.get(plural, str(ref.get("name") or ""), role_namespace)
            if role is not None and any(
                _grants(rule, verb=verb, group=group, resource=resource, name=name) for rule in role.get("rules") or []
            ):
                return True
    return False


def check_claim_status(
    store: Store,
    user: User | None,
    *,
    version: tuple[int, int],
    verb: str,
    name: str,
    old: dict[str, Any],
    new: dict[str, Any],
) -> None:
    """Refuse, as kube-apiserver >= 1.36 does, a status write changing the allocation or the reservations
    by a caller without ``resourceclaims/binding``."""
    if user is None or version < (1, 36):
        return
    before, after = old.get("status") or {}, new.get("status") or {}
    if before.get("allocation") == after.get("allocation") and before.get("reservedFor") == after.get("reservedFor"):
        return
    if allowed(store, user, verb=verb, group="resource.k8s.io", resource="resourceclaims/binding"):
        return
    why = f'User "{user.name}" cannot {verb} resource "resourceclaims/binding" in API group "resource.k8s.io"'
    message = BINDING_REFUSED.format(verb=verb, why=why)
    raise ApiError(
        422,
        "Invalid",
        f'ResourceClaim.resource.k8s.io "{name}" is invalid: status.allocation: Forbidden: {message}',
    )


def _names(subject: dict[str, Any], user: User) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        return user.name == f"system:serviceaccount:{subject.get('namespace')}:{subject.get('name')}"
    if kind == "User":
        return user.name == subject.get("name")
    if kind == "Group":
        return subject.get("name") in user.groups
    return False


def _grants(rule: dict[str, Any], *, verb: str, group: str, resource: str, name: str) -> bool:
    def has(field: str, value: str) -> bool:
        values = rule.get(field) or []
        return "*" in values or value in values

    names = rule.get("resourceNames") or []
    return (
        has("verbs", verb) and has("apiGroups", group) and has("resources", resource) and (not names or name in names)
    )
