"""The health port's answers (daemon.healthport.answer): a table of what a connection may send."""

from __future__ import annotations

import pytest

from gpushared.daemon.healthport import MAX_REQUEST_BYTES, answer


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),
        (b"GET /healthz?verbose HTTP/1.0\r\n\r\n", b"200"),
        (b"HEAD /healthz HTTP/1.1\r\n\r\n", b"200"),
        (b"GET /healthz HTTP/1.1\n\n", b"200"),
        (b"GET /metrics HTTP/1.1\r\n\r\n", b"404"),
        (b"GET /status HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /healthz HTTP/1.1\r\n\r\n", b"400"),
        (b"GET /healthz\r\n\r\n", b"400"),
        (b"\x00\xff garbage\r\n\r\n", b"400"),
        (b"G" * MAX_REQUEST_BYTES, b"400"),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", None),
        (b"", None),
    ],
)
def test_answers(request_bytes: bytes, status: bytes | None) -> None:
    response = answer(request_bytes)
    if status is None:
        assert response is None
    else:
        assert response is not None and response.split(b" ")[1] == status


def test_head_has_no_body() -> None:
    response = answer(b"HEAD /healthz HTTP/1.1\r\n\r\n")
    assert response is not None and response.endswith(b"\r\n\r\n")
