"""When a certificate stops being valid, read from the certificate itself: the ``validity`` of RFC 5280's
TBSCertificate, found by walking its DER encoding. Pure (bytes in, a time out), so the extender's serving
certificate and the node's client credentials report their expiry the same way, without a crypto library.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import UTC, datetime

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)
_SEQUENCE, _INTEGER, _VERSION = 0x30, 0x02, 0xA0
_UTC_TIME, _GENERALIZED_TIME = 0x17, 0x18


class CertificateError(ValueError):
    """Not a certificate this reader understands: the message says where it stopped."""


def pem_certificates(pem: bytes) -> list[bytes]:
    """The DER of every certificate in a PEM bundle, in order (keys and other blocks are skipped)."""
    blocks = []
    for match in _PEM.finditer(pem):
        try:
            blocks.append(base64.b64decode(b"".join(match[1].split()), validate=True))
        except binascii.Error as exc:
            raise CertificateError(f"a PEM certificate block is not base64: {exc}") from None
    return blocks


def _element(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, where its content starts, where it ends) of the DER element at ``at``."""
    if at + 2 > len(der):
        raise CertificateError(f"truncated at byte {at}")
    tag, first = der[at], der[at + 1]
    start = at + 2
    if first < 0x80:
        length = first
    else:
        count = first & 0x7F
        if count == 0 or count > 4 or start + count > len(der):
            raise CertificateError(f"bad length at byte {at}")
        length = int.from_bytes(der[start : start + count], "big")
        start += count
    if start + length > len(der):
        raise CertificateError(f"element at byte {at} runs past the end")
    return tag, start, start + length


def _time(der: bytes, at: int) -> tuple[datetime, int]:
    tag, start, end = _element(der, at)
    text = der[start:end].decode("ascii", errors="replace")
    try:
        if tag == _UTC_TIME:  # YYMMDDHHMMSSZ; RFC 5280: 50-99 are 19xx
            parsed = datetime.strptime(text, "%y%m%d%H%M%SZ")
            if parsed.year >= 2050:
                parsed = parsed.replace(year=parsed.year - 100)
        elif tag == _GENERALIZED_TIME:
            parsed = datetime.strptime(text, "%Y%m%d%H%M%SZ")
        else:
            raise CertificateError(f"expected a time at byte {at}, found tag {tag:#x}")
    except ValueError as exc:
        raise CertificateError(f"a validity time {text!r} does not parse: {exc}") from None
    return parsed.replace(tzinfo=UTC), end


def validity(der: bytes) -> tuple[datetime, datetime]:
    """(notBefore, notAfter) of a DER certificate, in UTC."""
    tag, start, _ = _element(der, 0)
    if tag != _SEQUENCE:
        raise CertificateError("not a certificate: it is not a SEQUENCE")
    tag, at, _ = _element(der, start)  # tbsCertificate
    if tag != _SEQUENCE:
        raise CertificateError("not a certificate: no TBSCertificate")
    tag, _, end = _element(der, at)
    if tag == _VERSION:  # [0] EXPLICIT version, absent in v1 certificates
        at = end
    for expected in (_INTEGER, _SEQUENCE, _SEQUENCE):  # serialNumber, signature, issuer
        tag, _, end = _element(der, at)
        if tag != expected:
            raise CertificateError(f"unexpected tag {tag:#x} at byte {at}")
        at = end
    tag, at, _ = _element(der, at)
    if tag != _SEQUENCE:
        raise CertificateError("no validity in the certificate")
    not_before, at = _time(der, at)
    not_after, _ = _time(der, at)
    return not_before, not_after


def not_after(pem: bytes) -> datetime:
    """When the first certificate of a PEM file (the leaf, in a chain) stops being valid."""
    certificates = pem_certificates(pem)
    if not certificates:
        raise CertificateError("no PEM certificate in it")
    return validity(certificates[0])[1]
