"""One request and its answer, whichever HTTP version carried them, and who the caller is.

HTTP/1.1 (``http1.py``) and HTTP/2 (``http2.py``) each only turn their bytes into a :class:`Call` and an
:class:`Answer` back into bytes; everything a caller can be told is decided once, above them, so the two
versions cannot answer the same request differently.
"""

from __future__ import annotations

import ssl
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

JSON = "application/json"
TEXT = "text/plain; charset=utf-8"


class BodyTooLarge(Exception):
    """The request's body passed ``ServerConfig.max_body_bytes``: raised by :attr:`Call.read`."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    content_type: str = JSON


@dataclass(frozen=True, slots=True)
class Call:
    """One request as the routes see it. ``read`` returns the body (raising :class:`BodyTooLarge` past the
    limit); the routes decide whether and when to read it, so a refused caller's body is never waited for."""

    method: str
    #: decoded, without the query
    path: str
    read: Callable[[], Awaitable[bytes]]
    #: the TLS connection it came on (its client certificate), None over plain HTTP
    ssl_object: ssl.SSLObject | None = None
    remote: str | None = None
    forwarded: bool = False


Handler = Callable[[Call], Awaitable[Answer]]


class Answering(Protocol):
    """What both HTTP versions hand each call to."""

    async def answer(self, call: Call) -> Answer: ...


def json_answer(body: Any, *, status: int = 200) -> Answer:
    return Answer(status, orjson.dumps(body))


def certificate_names(ssl_object: ssl.SSLObject | None) -> frozenset[str] | None:
    """The common names and DNS names of the caller's verified client certificate; None without one.
    Decoded once per connection: over HTTP/2 every call of kube-scheduler's comes on the same one."""
    if ssl_object is None:
        return None
    try:
        return _NAMES[ssl_object]
    except KeyError:
        pass
    certificate: Any = ssl_object.getpeercert()  # typeshed's type is looser than what it returns
    names = None
    if certificate:
        found = {value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"}
        found |= {value for kind, value in certificate.get("subjectAltName", ()) if kind == "DNS"}
        names = frozenset(found)
    _NAMES[ssl_object] = names
    return names


#: Each open connection's client certificate names, gone with the connection.
_NAMES: weakref.WeakKeyDictionary[ssl.SSLObject, frozenset[str] | None] = weakref.WeakKeyDictionary()
