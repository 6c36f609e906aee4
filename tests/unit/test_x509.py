"""core.shared.x509: when a certificate expires, read from the certificate, as openssl reads it; anything else
is a CertificateError naming where the reader stopped, never another exception."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushared.core.shared.x509 import CertificateError, not_after, pem_certificates, validity


def make(tmp_path: Path, *args: str) -> bytes:
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-nodes", "-subj", "/CN=t", "-keyout", key, "-out", cert, *args],
        check=True,
        capture_output=True,
    )
    return cert.read_bytes()


def openssl_end(pem: bytes) -> datetime:
    out = subprocess.run(
        ["openssl", "x509", "-noout", "-enddate"], input=pem, check=True, capture_output=True
    ).stdout.decode()
    return datetime.strptime(out.strip().removeprefix("notAfter="), "%b %d %H:%M:%S %Y %Z").replace(tzinfo=UTC)


@pytest.mark.parametrize(
    "args",
    [
        ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-days", "365"),  # what the chart makes
        ("-newkey", "rsa:2048", "-days", "2"),
        ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-days", "20000"),  # past 2049: GeneralizedTime
    ],
    ids=["ecdsa-year", "rsa-two-days", "generalized-time"],
)
def test_not_after_is_what_openssl_reads(tmp_path: Path, args: tuple[str, ...]) -> None:
    pem = make(tmp_path, *args)
    assert not_after(pem) == openssl_end(pem)
    before, after = validity(pem_certificates(pem)[0])
    assert before < after


def test_the_leaf_of_a_chain_and_blocks_that_are_not_certificates(tmp_path: Path) -> None:
    leaf = make(tmp_path, "-newkey", "rsa:2048", "-days", "2")
    other = make(tmp_path, "-newkey", "rsa:2048", "-days", "30")
    key = b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
    assert not_after(key + leaf + other) == openssl_end(leaf)
    assert len(pem_certificates(leaf + key + other)) == 2


@pytest.mark.parametrize(
    ("pem", "message"),
    [
        (b"", "no PEM certificate"),
        (b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n", "not base64"),
        (b"-----BEGIN CERTIFICATE-----\nAgEB\n-----END CERTIFICATE-----\n", "not a SEQUENCE"),
        (b"-----BEGIN CERTIFICATE-----\nMAM=\n-----END CERTIFICATE-----\n", "runs past the end"),
        (b"-----BEGIN CERTIFICATE-----\nMIQAAAAA\n-----END CERTIFICATE-----\n", "truncated"),
        (b"-----BEGIN CERTIFICATE-----\nMIUAAAAAAAA=\n-----END CERTIFICATE-----\n", "bad length"),
    ],
)
def test_what_is_not_a_certificate_is_refused_by_name(pem: bytes, message: str) -> None:
    with pytest.raises(CertificateError, match=message):
        not_after(pem)


@settings(max_examples=300, deadline=None)
@given(
    cut=st.integers(min_value=0, max_value=2000), flip=st.integers(min_value=0, max_value=2000), bit=st.integers(0, 7)
)
def test_damaged_certificates_raise_only_certificate_error(cut: int, flip: int, bit: int) -> None:
    der = bytearray(pem_certificates(ROOT_PEM)[0])
    if flip < len(der):
        der[flip] ^= 1 << bit
    damaged = bytes(der[: max(1, len(der) - cut % len(der))])
    try:
        before, after = validity(damaged)
    except CertificateError:
        return
    assert before.tzinfo is UTC and after.tzinfo is UTC  # a flip that left a readable validity: still times


#: A fixed certificate for the property test (openssl req -x509 -newkey ec ... -days 365, CN=t).
ROOT_PEM = b"""-----BEGIN CERTIFICATE-----
MIIBbDCCAROgAwIBAgIULQ/+hrTzpf4JSRmkFeW6KwTEnM8wCgYIKoZIzj0EAwIw
DDEKMAgGA1UEAwwBdDAeFw0yNjExMjYxNDEzNTNaFw0yNzExMjYxNDEzNTNaMAwx
CjAIBgNVBAMMAXQwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAATTFh60J/9AJCVQ
F0yQszDIBTPzU3WqUKrbwq0HQGFq4chfd/GaIdxsQi7oF8U9Z1nEo7PZVhQgqEt0
w8yVBEWIo1MwUTAdBgNVHQ4EFgQUe+MXNr1FjWF6L5B5UiCZlNcqiBgwHwYDVR0j
BBgwFoAUe+MXNr1FjWF6L5B5UiCZlNcqiBgwDwYDVR0TAQH/BAUwAwEB/zAKBggq
hkjOPQQDAgNHADBEAiBFXtv4NJT9NEiiXkTl1XK6XRQo6x0+Ruhojdb2/WxpJQIg
HXsf7oY4KMKgFOKMkKK1psaH3zHY6CsFo78yEXz1Cq8=
-----END CERTIFICATE-----
"""
