"""Bound ServiceAccount tokens: whose they are, when they expire, and when to ask for the next one.

The node daemon's identity on a host is a ServiceAccount token in its kubeconfig. Tokens from the
TokenRequest API (``kubectl create token``) expire, and the API server may cap their life (managed control
planes: a day or two), so the daemon asks for its next token itself before the one it has runs out, as the
kubelet does for a pod's projected token: once 80 % of its life has passed, or 24 hours, whichever comes
first. The claims are read without checking the signature: the API server checks it; this only decides
when to renew. Pure: a token in, times out.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

#: Renew once this share of a token's life has passed...
RENEW_FRACTION = 0.8
#: ...or this many seconds, whichever comes first (the kubelet's rule for projected tokens).
RENEW_AFTER_SECONDS = 24 * 3600.0


@dataclass(frozen=True)
class BoundToken:
    """The claims of a ServiceAccount token that expires."""

    namespace: str
    service_account: str
    issued_at: float
    expires_at: float

    @property
    def lifetime(self) -> float:
        return self.expires_at - self.issued_at

    def renew_at(self) -> float:
        """When to ask for the next token (Unix seconds)."""
        return self.issued_at + min(RENEW_FRACTION * self.lifetime, RENEW_AFTER_SECONDS)


def read_bound_token(token: str) -> BoundToken | None:
    """The claims of a bound ServiceAccount token; None for anything else (a token Secret's legacy token,
    which never expires, an OIDC token, a static token): those are not renewed here."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    claims = payload.get("kubernetes.io")
    issued, expires = payload.get("iat"), payload.get("exp")
    if not isinstance(claims, dict) or not isinstance(issued, int | float) or not isinstance(expires, int | float):
        return None
    account = claims.get("serviceaccount")
    namespace = claims.get("namespace")
    if not isinstance(account, dict) or not isinstance(namespace, str) or not isinstance(account.get("name"), str):
        return None
    if expires <= issued:
        return None
    return BoundToken(namespace, account["name"], float(issued), float(expires))
