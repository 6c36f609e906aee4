"""What stands between a caller and a verb: authentication, readiness, the body's limits and timeout,
forwarding to the leader, and the status a failure gets (400 for a malformed body, 500 for a bug).

The same for every verb and both HTTP versions; the verbs themselves (``extender.routes``) get the body
only once all of this has passed, and answer from it alone.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp
from prometheus_client import Counter, Histogram

from gpushared.extender.http.calls import JSON, Answer, BodyTooLarge, Call, Handler, certificate_names, json_answer
from gpushared.extender.http.config import ServerConfig
from gpushared.extender.http.wire import WireError

log = logging.getLogger(__name__)

Ready = Callable[[], tuple[bool, str]]
#: None: serve the verbs here. A URL: the leader's, to forward them to. "": no leader known yet.
Leader = Callable[[], str | None]
#: The header a follower marks a forwarded verb with, so a leader that lost its Lease meanwhile does not
#: forward it again.
FORWARDED = "X-Gpushared-Forwarded"


class Renewals(Protocol):
    """How many times the TLS files were read anew (``tls.ServingTls``): a client built before the last
    time presents certificates that may no longer be trusted."""

    @property
    def generation(self) -> int: ...


def client_context(config: ServerConfig) -> ssl.SSLContext | None:
    """What a follower presents to the leader: its own certificate, trusting the serving certificate's
    chain (or the client CA, which signs both in every shipped setup)."""
    if config.tls_cert is None:
        return None
    context = ssl.create_default_context(cafile=str(config.tls_cert))
    # Replicas reach each other by pod IP, which their certificate does not name; the chain is still
    # verified against the certificate (self-signed) or the CA.
    context.check_hostname = False
    if config.client_ca is not None:
        context.load_verify_locations(cafile=str(config.client_ca))
        context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    return context


class Guard:
    def __init__(
        self,
        config: ServerConfig,
        *,
        tls: Renewals,
        ready: Ready,
        leader: Leader,
        seconds: Histogram,
        errors: Counter,
    ) -> None:
        """``seconds`` and ``errors``: the latency histogram and error counter, labelled by verb; ``tls``: the
        certificates a follower presents to the leader, as they are now."""
        self.config = config
        self.tls = tls
        self.ready = ready
        self.leader = leader
        self.seconds, self.errors = seconds, errors
        self._session: aiohttp.ClientSession | None = None
        self._session_generation = -1

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def verb(self, name: str, handler: Callable[[bytes], Awaitable[Answer]], *, stateless: bool = False) -> Handler:
        """Authentication, readiness, body limits and timeouts, 400 for a malformed body, and the latency
        metric.

        A ``stateless`` verb answers from the request alone (the webhook): every replica serves it, synced
        or not, leader or not, and it asks for no client certificate."""

        seconds, errors = self.seconds.labels(verb=name), self.errors.labels(verb=name)  # once

        async def serve(call: Call) -> Answer:
            started = time.perf_counter()
            try:
                answer = await self._serve(name, handler, call, stateless=stateless)
                if answer.status >= 400:
                    errors.inc()
                return answer
            finally:
                seconds.observe(time.perf_counter() - started)

        return serve

    async def _serve(
        self, name: str, handler: Callable[[bytes], Awaitable[Answer]], call: Call, *, stateless: bool
    ) -> Answer:
        refused = None if stateless else self.unauthenticated(call, name)
        if refused is not None:
            log.warning("%s from %s refused: %s", name, call.remote, refused[1])
            return json_answer({"Error": refused[1]}, status=refused[0])
        ok, why = (True, "") if stateless else self.ready()
        if not ok:
            return json_answer({"Error": why}, status=503)
        try:
            async with asyncio.timeout(self.config.read_timeout):  # no task per request, unlike wait_for
                raw = await call.read()
        except BodyTooLarge:
            limit = self.config.body_limit(call.path)
            return json_answer({"Error": f"{name}: body larger than {limit} bytes"}, status=413)
        except TimeoutError:
            return json_answer({"Error": f"{name}: request body too slow"}, status=408)
        leader = None if stateless else self.leader()
        if leader is not None:
            if call.forwarded or not leader:
                return json_answer({"Error": "this replica is not the leader, and no leader is known"}, status=503)
            return await self._forward(call.path, raw, leader)
        try:
            return await handler(raw)
        except WireError as exc:
            return json_answer({"Error": str(exc)}, status=400)
        except Exception as exc:  # a bug, never a caller's fault: say so, keep serving
            log.exception("%s failed", name)
            return json_answer({"Error": f"{name}: internal error ({type(exc).__name__}); see the log"}, status=500)

    def unauthenticated(self, call: Call, verb: str = "") -> tuple[int, str] | None:
        """The HTTP status and reason the caller may not use the verbs with (None: it may): 401 without a
        client certificate, 403 with one whose name is not allowed. Without --client-ca anyone may read
        (filter, prioritize), and nobody may bind unless --insecure-bind says so: a bind changes the
        cluster, and without client certificates anyone who knows a pod's UID could bind it anywhere."""
        if self.config.client_ca is None:
            if verb == "bind" and not self.config.insecure_bind:
                return 403, (
                    "bind needs client authentication: start the extender with --tls-cert, --tls-key and "
                    "--client-ca (or --insecure-bind, where anyone who reaches this port may bind pods)"
                )
            return None
        names = certificate_names(call.ssl_object)
        if names is None:
            return 401, "a client certificate signed by the extender's client CA is required"
        if self.config.client_names and not names & self.config.client_names:
            return 403, f"client certificate {sorted(names)} is not allowed here"
        return None

    def authenticated(self, call: Call) -> bool:
        """Whether the caller presented a client certificate the verbs accept (never, without --client-ca)."""
        return self.config.client_ca is not None and self.unauthenticated(call) is None

    async def _forward(self, path: str, raw: bytes, leader: str) -> Answer:
        """A follower passes the verb to the leader, so every replica can be Ready behind the Service."""
        if self._session is not None and self._session_generation != self.tls.generation:
            # The certificates were renewed: present the new ones from the next call on.
            await self._session.close()
            self._session = None
        if self._session is None:
            config = self.config
            # The leader asks for a client certificate too: this replica presents its own.
            context = client_context(config)
            self._session_generation = self.tls.generation
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=config.read_timeout),
                connector=aiohttp.TCPConnector(ssl=context) if context else None,
            )
        try:
            async with self._session.post(
                leader + path, data=raw, headers={"Content-Type": JSON, FORWARDED: "1"}
            ) as answer:
                return Answer(answer.status, await answer.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            return json_answer({"Error": f"the leader at {leader} did not answer: {exc}"}, status=503)
