"""core.node.tokens: which tokens are bound ServiceAccount tokens, and when the next one is asked for."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from gpushared.core.node.tokens import RENEW_AFTER_SECONDS, BoundToken, read_bound_token


def jwt(claims: Any, *, parts: int = 3) -> str:
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return ".".join(["eyJhbGciOiJSUzI1NiJ9", payload, "sig"][:parts])


BOUND = {
    "iat": 1_000,
    "exp": 4_600,
    "sub": "system:serviceaccount:kube-system:gpushared-node",
    "kubernetes.io": {"namespace": "kube-system", "serviceaccount": {"name": "gpushared-node", "uid": "u"}},
}


def test_a_bound_token_says_whose_it_is_and_when_it_expires() -> None:
    token = read_bound_token(jwt(BOUND))
    assert token == BoundToken("kube-system", "gpushared-node", 1_000.0, 4_600.0)
    assert token.lifetime == 3_600


@pytest.mark.parametrize(
    ("issued", "expires", "renew_at"),
    [
        (0, 3_600, 2_880),  # an hour: at 80 %
        (0, 10, 8),  # seconds: at 80 % too
        (0, 48 * 3600, RENEW_AFTER_SECONDS),  # two days (GKE's cap): after a day, not at 80 %
        (0, 365 * 86400, RENEW_AFTER_SECONDS),  # a year: daily
    ],
)
def test_renewal_is_due_at_80_percent_of_its_life_or_after_a_day(issued: int, expires: int, renew_at: float) -> None:
    token = read_bound_token(jwt({**BOUND, "iat": issued, "exp": expires}))
    assert token is not None and token.renew_at() == renew_at


@pytest.mark.parametrize(
    "token",
    [
        "fake",  # a static token
        jwt(BOUND, parts=2),
        "a.!!!.c",
        jwt([1, 2]),
        jwt({k: v for k, v in BOUND.items() if k != "exp"}),  # a token Secret's legacy token: never expires
        jwt({k: v for k, v in BOUND.items() if k != "kubernetes.io"}),  # an OIDC token
        jwt({**BOUND, "exp": "soon"}),
        jwt({**BOUND, "exp": 1_000}),  # expires when issued
        jwt({**BOUND, "kubernetes.io": {"namespace": "kube-system", "serviceaccount": "gpushared-node"}}),
        "a." + base64.urlsafe_b64encode(b"\xff\xfe").decode() + ".c",
    ],
    ids=range(10),
)
def test_anything_else_is_not_renewed(token: str) -> None:
    assert read_bound_token(token) is None
