"""The claims prepared on this node, on disk: the checkpoint and one CDI spec per claim.

Order makes it crash-safe. Preparing writes the claim's CDI spec, then the checkpoint that names it;
unpreparing drops the claim from the checkpoint, then its spec. A daemon killed between the two steps
leaves at most a spec the checkpoint does not name, and the next start removes those (only when the
checkpoint was read: an unreadable checkpoint is kept aside and no spec is touched, since a container of a
running pod that restarts needs its spec again). Both files are written whole, to a temporary file that
is then renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from gpushared.contract import ContractError, dra
from gpushared.core.checkpoint import format_checkpoint, parse_checkpoint
from gpushared.core.prepare import PreparedClaim, cdi_spec

log = logging.getLogger(__name__)

#: The file name prefix of the driver's CDI specs: ``<vendor>-<class>_<claim UID>.json``.
CDI_PREFIX = f"{dra.CDI_VENDOR}-{dra.CDI_CLASS}_"


class ClaimBook:
    def __init__(self, *, checkpoint: Path, cdi_root: Path) -> None:
        self.checkpoint = checkpoint
        self.cdi_root = cdi_root
        self._claims: dict[str, PreparedClaim] = {}
        self._lock = threading.Lock()
        #: changes whenever the prepared claims do (the memory watcher reads their pods' allowances again)
        self.version = 0

    def load(self) -> None:
        """Read the checkpoint; write the specs it names that are missing, remove those it does not name."""
        try:
            text = self.checkpoint.read_text()
        except FileNotFoundError:
            text = None
        claims: list[PreparedClaim] = []
        if text is not None:
            try:
                claims = parse_checkpoint(text)
            except ContractError as exc:
                aside = self.checkpoint.with_name(self.checkpoint.name + ".unreadable")
                os.replace(self.checkpoint, aside)
                log.error("DRA checkpoint %s unreadable (%s); kept as %s, starting empty", self.checkpoint, exc, aside)
                return
        with self._lock:
            self._claims = {c.ref.uid: c for c in claims}
            self.version += 1
            for claim in claims:
                path = self.cdi_path(claim.ref.uid)
                if not path.exists():
                    _write(path, json.dumps(cdi_spec(claim), indent=1))
                    log.info("rewrote CDI spec %s of claim %s", path, claim.ref.key)
            if self.cdi_root.is_dir():
                for path in self.cdi_root.glob(f"{CDI_PREFIX}*.json"):
                    uid = path.name[len(CDI_PREFIX) : -len(".json")]
                    if uid not in self._claims:
                        path.unlink(missing_ok=True)
                        log.info("removed CDI spec %s: its claim is not prepared", path)

    def claims(self) -> list[PreparedClaim]:
        with self._lock:
            return list(self._claims.values())

    def by_name(self) -> dict[tuple[str, str], PreparedClaim]:
        """The prepared claims by namespace and name, as pods name them."""
        with self._lock:
            return {(c.ref.namespace, c.ref.name): c for c in self._claims.values()}

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get(uid)

    def cdi_path(self, uid: str) -> Path:
        return self.cdi_root / f"{CDI_PREFIX}{uid}.json"

    def record(self, claim: PreparedClaim) -> None:
        """Spec first, then the checkpoint: what the checkpoint names always exists."""
        with self._lock:
            _write(self.cdi_path(claim.ref.uid), json.dumps(cdi_spec(claim), indent=1))
            claims = {**self._claims, claim.ref.uid: claim}
            _write(self.checkpoint, format_checkpoint(list(claims.values())))
            self._claims = claims
            self.version += 1

    def forget(self, uid: str) -> bool:
        """Checkpoint first, then the spec; False when the claim was not prepared here (nothing to do)."""
        with self._lock:
            if uid not in self._claims:
                self.cdi_path(uid).unlink(missing_ok=True)
                return False
            claims = {k: v for k, v in self._claims.items() if k != uid}
            _write(self.checkpoint, format_checkpoint(list(claims.values())))
            self._claims = claims
            self.version += 1
            self.cdi_path(uid).unlink(missing_ok=True)
            return True


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
