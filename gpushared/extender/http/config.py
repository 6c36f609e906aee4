"""What the extender's HTTP service listens on, whom it answers, and the limits it holds callers to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpushared.extender.http import wire

#: The largest admission review the webhook reads: kube-apiserver takes request bodies of at most 3 MiB,
#: so a pod it asks about is no larger; anyone else's larger review is refused unread (413).
MAX_REVIEW_BYTES = 3 * 2**20 + 64 * 2**10


@dataclass(frozen=True)
class ServerConfig:
    address: str = "0.0.0.0"
    port: int = 39999
    prefix: str = "/gpushare-scheduler"
    #: the body is parsed on the event loop; why 8 MiB: docs/benchmarks.md, "What a request may hold the
    #: event loop for"
    max_body_bytes: int = 8 * 2**20
    max_nodes: int = wire.MAX_NODES
    read_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: mutual TLS: the verbs answer only callers whose client certificate this CA signed
    client_ca: Path | None = None
    #: and, if any are given, whose certificate's common name or DNS name is one of these
    client_names: frozenset[str] = frozenset()
    #: how often the TLS files are read for a change (http/tls.py: served without a restart)
    tls_reload_seconds: float = 10.0
    #: /inspect names pods to callers without a client certificate too
    public_pod_names: bool = False
    #: without client_ca, bind anyway: anyone who reaches the port can then bind any pod whose UID it knows
    #: (benchmarks and tests on loopback; never a cluster)
    insecure_bind: bool = False

    def body_limit(self, path: str) -> int:
        """The most of a body read on ``path``: the webhook's reviews are held to what the API server can send,
        before they are read (a stranger's 8 MiB review is refused at its first bytes past 3 MiB)."""
        if path == f"{self.prefix.rstrip('/')}/mutate":
            return min(self.max_body_bytes, MAX_REVIEW_BYTES)
        return self.max_body_bytes
