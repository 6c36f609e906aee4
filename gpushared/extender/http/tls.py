"""The extender's TLS material, read again when its files change, so that a rotated certificate (a Secret
cert-manager or the Helm chart renewed, which the kubelet swaps into the pod's volume) is served without a
restart.

The listening socket keeps the context it was opened with; each handshake is moved to the newest context
in the SNI callback, which OpenSSL calls for every ClientHello, with a server name or without. A context
carries the serving certificate and key, ALPN and, for mutual TLS, the client CA, so a new CA is trusted
and an old one dropped at the same moment. The files are polled (a Secret volume changes by an atomic swap
of a symlink, a hostPath one by whatever wrote it); a set that does not load, say a certificate written
before its key, is kept out until it does, and the last good one goes on serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from pathlib import Path

from prometheus_client import Gauge

from gpushared.core.shared.x509 import CertificateError, not_after
from gpushared.extender.http.config import ServerConfig

log = logging.getLogger(__name__)

#: What the extender offers in the TLS handshake, preferred first.
ALPN = ("h2", "http/1.1")


def server_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The serving context for ``config``'s files; None without TLS. Raises what loading them raises."""
    if config.tls_cert is None and config.tls_key is None:
        if config.client_ca is not None:
            raise ValueError("client certificates need TLS: give a certificate and a key too")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ValueError("TLS needs both a certificate and a key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    context.set_alpn_protocols(ALPN)
    # A connection's client certificate is checked once (routes.certificate_names): no renegotiation
    # may present another one later. (TLS 1.3 has none; this closes TLS 1.2's.)
    context.options |= ssl.OP_NO_RENEGOTIATION
    if config.client_ca is not None:
        # Optional at the handshake, so kubelet's probes reach /healthz and /readyz; a certificate that is
        # presented must verify, and the verbs refuse a caller without one (Guard.unauthenticated).
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cafile=str(config.client_ca))
    return context


class ServingTls:
    """The current TLS contexts of one extender, and when its certificates expire.

    ``generation`` grows with each reload, so that a client built from the old files (the follower's
    session to the leader) knows to build itself again.
    """

    def __init__(self, config: ServerConfig, *, expiry: Gauge | None = None) -> None:
        self.config = config
        self.expiry = expiry
        self.generation = 0
        self._files = tuple(p for p in (config.tls_cert, config.tls_key, config.client_ca) if p is not None)
        files = self._read()
        self._digest = self._digest_of(files)
        self.current = server_context(config)  # raises: a bad set at start stops the extender
        self.listening = self.current
        if self.listening is not None:
            self.listening.sni_callback = self._to_current
        self._report_expiry(files)

    def _read(self) -> dict[Path, bytes]:
        return {Path(path): Path(path).read_bytes() for path in self._files}

    @staticmethod
    def _digest_of(files: dict[Path, bytes]) -> str:
        digest = hashlib.sha256()
        for content in files.values():
            digest.update(content)
            digest.update(b"\0")
        return digest.hexdigest()

    def _to_current(self, connection: ssl.SSLObject | ssl.SSLSocket, _name: str | None, used: ssl.SSLContext) -> None:
        current = self.current
        if current is not None and current is not used:
            connection.context = current

    def reload(self) -> bool:
        """Read the files again; if they changed and load, serve them from the next handshake on."""
        if self.listening is None:
            return False
        try:
            files = self._read()
            digest = self._digest_of(files)
            if digest == self._digest:
                return False
            fresh = server_context(self.config)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.warning("TLS files changed but do not load (%s): serving the previous ones until they do", exc)
            return False
        assert fresh is not None  # TLS was on at start, and the paths are the same
        self.current, self._digest = fresh, digest
        self.generation += 1
        expires = self._report_expiry(files)
        log.info("TLS certificates reloaded (serving certificate valid until %s)", expires or "unknown")
        return True

    def _report_expiry(self, files: dict[Path, bytes]) -> str | None:
        """Set the expiry gauge for the serving certificate and the client CA from the ``files`` just read
        (not read again: what is reported is what was loaded); the serving one's date, as text."""
        shown = None
        for name, path in (("serving", self.config.tls_cert), ("client-ca", self.config.client_ca)):
            if path is None:
                continue
            try:
                when = not_after(files[Path(path)])
            except CertificateError as exc:
                log.warning("cannot read when %s expires: %s", path, exc)
                continue
            if self.expiry is not None:
                self.expiry.labels(certificate=name).set(when.timestamp())
            if name == "serving":
                shown = when.isoformat()
        return shown

    async def keep_fresh(self, stop: asyncio.Event) -> None:
        """Reload on change, every ``tls_reload_seconds`` (the kubelet refreshes a Secret volume within about a
        minute), until ``stop``."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.config.tls_reload_seconds)
            except TimeoutError:
                self.reload()
