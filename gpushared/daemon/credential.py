"""The daemon's own identity, renewed before it expires.

On a host the daemon authenticates with the ServiceAccount token in its kubeconfig
(``scripts/node-kubeconfig``). A token from the TokenRequest API expires, and managed control planes cap
its life at a day or two, so the daemon asks the API server for its next one (the same ServiceAccount,
the same lifetime) once ``core.node.tokens`` says it is due, keeps it in ``renewedTokenFile`` (0600, replaced
atomically) and uses it from the next request on; after a restart the one issued last is used. A renewal
that fails is tried again (every tenth of the time left, between 1 and 60 s), logged, counted, and
reported as a ``CredentialRenewalFailed`` Event on the Node while the old token still works; when it runs
out the daemon can no longer reach the API server, and ``gpushared_credential_expiry_seconds`` will have
said when. Tokens that do not expire (a token Secret's) and other credentials are left as they are.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpushared.core.node.tokens import BoundToken, read_bound_token
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.kube.api import Api
from gpushared.kube.credentials import StaticCredential
from gpushared.kube.errors import KubeError

log = logging.getLogger(__name__)

COMPONENT = "gpushared"
EVENT_RENEWAL_FAILED = "CredentialRenewalFailed"


class TokenRenewer:
    def __init__(
        self,
        api: Api,
        credential: StaticCredential,
        current: BoundToken,
        *,
        saved: Path,
        node: str,
        metrics: DaemonMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api, self.credential, self.current = api, credential, current
        self.saved, self.node, self.metrics, self.clock = saved, node, metrics, clock
        self.failures = 0

    @classmethod
    def attach(cls, api: Api, *, saved: Path, node: str, metrics: DaemonMetrics) -> TokenRenewer | None:
        """A renewer for ``api``'s credential when it is a bound ServiceAccount token; None otherwise."""
        credential = api.rest.credentials.credential
        if not isinstance(credential, StaticCredential) or not credential.token:
            return None
        current = read_bound_token(credential.token)
        if current is None:
            return None
        renewer = cls(api, credential, current, saved=saved, node=node, metrics=metrics)
        renewer._adopt_saved()
        renewer._report()
        return renewer

    def _adopt_saved(self) -> None:
        """Use the token renewed before a restart when it is the same account's and was issued after the
        kubeconfig's: one renewed from it. A kubeconfig written since (``node-kubeconfig`` run again, say
        after the ServiceAccount was recreated to revoke its tokens) holds a newer token, and wins."""
        try:
            token = self.saved.read_text().strip()
        except OSError:
            return
        claims = read_bound_token(token)
        if claims is None or (claims.namespace, claims.service_account) != (
            self.current.namespace,
            self.current.service_account,
        ):
            return
        if claims.issued_at > self.current.issued_at:
            self.credential.token, self.current = token, claims

    def _report(self) -> None:
        self.metrics.credential_expiry.set(self.current.expires_at)

    def due_in(self) -> float:
        """Seconds until the next renewal (or retry) is due."""
        if self.failures:
            left = self.current.expires_at - self.clock()
            return min(60.0, max(1.0, left / 10))
        return max(0.0, self.current.renew_at() - self.clock())

    def renew(self) -> bool:
        """Ask for the next token now; True when it is in use."""
        account = f"{self.current.namespace}/{self.current.service_account}"
        seconds = max(600, int(self.current.lifetime))  # the API server's minimum is 10 minutes
        try:
            token = self.api.request_token(self.current.namespace, self.current.service_account, seconds=seconds)
            claims = read_bound_token(token)
            if claims is None:
                raise KubeError(f"token for {account}: the API server's answer is not a bound token")
            self._save(token)
        except (KubeError, OSError) as exc:
            self._failed(account, str(exc))
            return False
        self.credential.token, self.current = token, claims
        self.failures = 0
        self._report()
        log.info("renewed the token of %s; valid for %.0f s", account, claims.lifetime)
        return True

    def _save(self, token: str) -> None:
        self.saved.parent.mkdir(parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(dir=self.saved.parent, prefix=".token-")  # 0600
        try:
            with os.fdopen(fd, "w") as out:
                out.write(token)
            os.replace(staged, self.saved)
        except BaseException:
            Path(staged).unlink(missing_ok=True)
            raise

    def _failed(self, account: str, why: str) -> None:
        self.failures += 1
        self.metrics.credential_renewal_failures.inc()
        left = self.current.expires_at - self.clock()
        message = (
            f"renewing the token of {account} failed ({why}); the current one expires in {max(0, left):.0f} s, "
            "after which gpushared cannot reach the API server: check its RBAC (serviceaccounts/token create)"
        )
        log.warning("%s", message)
        if self.failures == 1 and left > 0:  # once per run of failures, while the old token still works
            try:
                self.api.node_event(
                    self.node, reason=EVENT_RENEWAL_FAILED, message=message[:1000], warning=True, component=COMPONENT
                )
            except KubeError as exc:
                log.warning("could not report it as an Event: %s", exc)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.due_in()):
            self.renew()
