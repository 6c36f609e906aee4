"""The claims prepared on this node, on disk: one checkpoint record and one CDI spec per claim.

Order makes it crash-safe. Preparing writes the claim's CDI spec, then its record; unpreparing removes the
record, then the spec. A daemon killed between the two steps leaves at most a spec no record names, and
the next start removes those. Each file is written whole to a temporary file that is then renamed, so a
reader never sees half of one, and a claim costs two small files whatever the number of claims: no
whole-checkpoint rewrite per claim (prepare stays flat to thousands of claims, docs/benchmarks.md).

Everything read back is bounded and checked: at most ``MAX_RECORDS`` records of at most ``MAX_RECORD_BYTES``
each, regular files only, the UID in the file's name and in its body the same valid UID. A record that
fails any check is set aside (renamed ``*.unreadable``, reported by :meth:`ClaimBook.load`) and the spec of
its claim is left as it is, since a container of a running pod that restarts needs it again. A checkpoint
of the single-file layout before (``checkpoint.json``) is read once and split into records.

:class:`DriverLock` keeps the node to one DRA driver: two daemons that each keep their claims in memory
would each count a GPU without the other's claims, and remove each other's specs on their next start.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from gpushared.contract import ContractError, dra
from gpushared.core.dra.allocated import ClaimRef
from gpushared.core.dra.checkpoint import format_checkpoint, parse_checkpoint
from gpushared.core.dra.prepare import PreparedClaim, cdi_spec

log = logging.getLogger(__name__)

#: The file name prefix of the driver's CDI specs: ``<vendor>-<class>_<claim UID>.json``.
CDI_PREFIX = f"{dra.CDI_VENDOR}-{dra.CDI_CLASS}_"
#: Records read at start, at most: a node's claims each hold at least one memory unit of a GPU, so even a
#: node of 8 GPUs of 141 GiB counts in GiB holds 1,128; past this the book refuses new claims.
MAX_RECORDS: Final = 16_384
#: One record's size, at most: a claim of 32 devices with its CDI edits is some tens of KiB.
MAX_RECORD_BYTES: Final = 1 << 20
#: The single-file checkpoint of releases before, read once: ``MAX_RECORDS`` claims of some KiB each.
MAX_LEGACY_BYTES: Final = 64 << 20
#: CDI spec files looked at for orphans at start, at most (the driver writes one per claim).
MAX_SPECS: Final = 4 * MAX_RECORDS
#: What a set-aside file's name ends with.
UNREADABLE: Final = ".unreadable"


class BookFull(Exception):
    """The node holds ``MAX_RECORDS`` prepared claims: a new one is refused, not written unbounded."""


class ClaimMismatch(Exception):
    """Unprepare named a UID prepared here under another namespace or name: nothing is removed."""


class ClaimBook:
    """``directory``: the claims' records (``<kubelet>/plugins/<driver>/claims``); ``legacy``: the
    single-file checkpoint of releases before, if any; ``cdi_root``: where the runtime reads CDI specs."""

    def __init__(self, *, directory: Path, cdi_root: Path, legacy: Path | None = None) -> None:
        self.directory = directory
        self.cdi_root = cdi_root
        self.legacy = legacy
        self._claims: dict[str, PreparedClaim] = {}
        self._lock = threading.Lock()  # guards the dict only; files are written outside it
        #: changes whenever the prepared claims do (the memory watcher reads their pods' allowances again)
        self.version = 0

    # --- start ------------------------------------------------------------------------------------------

    def load(self) -> list[str]:
        """Read the records; write the specs they name that are missing, remove those no claim names.
        Returns what was set aside, in words, for the log and the node's Events."""
        damaged: list[str] = []
        kept_specs: set[str] = set()  # UIDs whose spec stays although no record was read: set aside
        claims: dict[str, PreparedClaim] = {}
        self._make_directory(damaged)
        legacy = self._read_legacy(damaged)
        if legacy is not None and self.legacy is not None:
            for claim in legacy:
                _write(self._record_path(claim.ref.uid), format_checkpoint([claim]))
            self.legacy.unlink()  # its claims are records now
            log.info("DRA checkpoint %s split into %d records", self.legacy, len(legacy))
        for path in self._entries(self.directory, suffix=".json", limit=MAX_RECORDS, damaged=damaged):
            uid = path.name[: -len(".json")]
            record, why = _read_record(path, uid)
            if record is None:
                damaged.append(_set_aside(path, why))
                if dra.is_claim_uid(uid):
                    kept_specs.add(uid)
                continue
            claims[uid] = record
        with self._lock:
            self._claims = claims
            self.version += 1
        for claim in claims.values():
            path = self.cdi_path(claim.ref.uid)
            if not path.exists():
                _write(path, json.dumps(cdi_spec(claim), indent=1))
                log.info("rewrote CDI spec %s of claim %s", path, claim.ref.key)
        if self.cdi_root.is_dir():
            specs = self._entries(self.cdi_root, suffix=".json", prefix=CDI_PREFIX, limit=MAX_SPECS, damaged=[])
            for path in specs:
                uid = path.name[len(CDI_PREFIX) : -len(".json")]
                if uid not in claims and uid not in kept_specs:
                    path.unlink(missing_ok=True)
                    log.info("removed CDI spec %s: its claim is not prepared", path)
        for line in damaged:
            log.error("DRA checkpoint: %s", line)
        return damaged

    def _make_directory(self, damaged: list[str]) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file (or a link) where the directory belongs
            damaged.append(_set_aside(self.directory, "not a directory"))
            self.directory.mkdir(parents=True)

    def _read_legacy(self, damaged: list[str]) -> list[PreparedClaim] | None:
        """The claims of a single-file checkpoint, None where there is none or it was set aside."""
        if self.legacy is None or not os.path.lexists(self.legacy):
            return None
        text, why = _read_bounded(self.legacy, MAX_LEGACY_BYTES)
        if text is not None:
            try:
                claims = parse_checkpoint(text)
            except ContractError as exc:
                why = str(exc)
            else:
                if len(claims) <= MAX_RECORDS:
                    return claims
                why = f"{len(claims)} claims; at most {MAX_RECORDS}"
        damaged.append(_set_aside(self.legacy, why or "unreadable"))
        return None

    def _entries(
        self, directory: Path, *, suffix: str, limit: int, damaged: list[str], prefix: str = ""
    ) -> Iterator[Path]:
        """The directory's names with ``prefix`` and ``suffix``, at most ``limit`` of them (sorted)."""
        names: list[str] = []
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.startswith(prefix) and entry.name.endswith(suffix) and not entry.name.startswith("."):
                    names.append(entry.name)
                    if len(names) > limit:
                        damaged.append(f"{directory} holds more than {limit} files; only the first {limit} read")
                        break
        for name in sorted(names)[:limit]:
            yield directory / name

    # --- reading ----------------------------------------------------------------------------------------

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

    def __len__(self) -> int:
        with self._lock:
            return len(self._claims)

    def cdi_path(self, uid: str) -> Path:
        return self.cdi_root / f"{CDI_PREFIX}{_checked(uid)}.json"

    def _record_path(self, uid: str) -> Path:
        return self.directory / f"{_checked(uid)}.json"

    # --- writing ----------------------------------------------------------------------------------------

    def record(self, claim: PreparedClaim) -> None:
        """Spec first, then the record: what a record names always exists. The caller decides one claim
        UID at a time (``DraDriver``), so no two writes of one claim's files race."""
        if len(self) >= MAX_RECORDS and self.get(claim.ref.uid) is None:
            raise BookFull(f"node holds {MAX_RECORDS} prepared claims, the most one driver keeps")
        _write(self.cdi_path(claim.ref.uid), json.dumps(cdi_spec(claim), indent=1))
        _write(self._record_path(claim.ref.uid), format_checkpoint([claim]))
        with self._lock:
            self._claims[claim.ref.uid] = claim
            self.version += 1

    def forget(self, ref: ClaimRef) -> bool:
        """Record first, then the spec; False when the claim was not prepared here (its stray spec, if
        any, is removed). A UID prepared under another namespace or name raises :class:`ClaimMismatch`."""
        known = self.get(ref.uid)
        if known is None:
            self.cdi_path(ref.uid).unlink(missing_ok=True)
            return False
        if known.ref != ref:
            raise ClaimMismatch(f"claim UID {ref.uid} is prepared here as {known.ref.key}, not as {ref.key}")
        self._record_path(ref.uid).unlink(missing_ok=True)
        with self._lock:
            self._claims.pop(ref.uid, None)
            self.version += 1
        self.cdi_path(ref.uid).unlink(missing_ok=True)
        return True


class DriverLock:
    """An exclusive lock on ``<kubelet>/plugins/<driver>/driver.lock``, held for the daemon's life: a
    second daemon serving DRA on the node (the .deb's unit beside the chart's DaemonSet, a mistaken second
    start) is refused at start instead of sharing the claims' files. The kernel drops it when the process
    ends, however it ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """None when held now; else who holds it, in words."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return f"process {holder}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _checked(uid: str) -> str:
    if not dra.is_claim_uid(uid):
        raise ValueError(f"claim UID {uid[:80]!r} is not a Kubernetes UID")
    return uid


def _read_bounded(path: Path, limit: int) -> tuple[str | None, str]:
    """The text of a regular file of at most ``limit`` bytes, or None and why not (a FIFO, a device, a
    directory or a link is never opened for reading)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"cannot open: {exc.strerror}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "not a regular file"
        if info.st_size > limit:
            return None, f"{info.st_size} bytes; at most {limit}"
        data = os.read(fd, limit + 1)
    except OSError as exc:
        return None, f"cannot read: {exc.strerror}"
    finally:
        os.close(fd)
    if len(data) > limit:
        return None, f"over {limit} bytes"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 ({exc.reason} at byte {exc.start})"


def _read_record(path: Path, uid: str) -> tuple[PreparedClaim | None, str]:
    if not dra.is_claim_uid(uid):
        return None, "its name is not a claim UID"
    text, why = _read_bounded(path, MAX_RECORD_BYTES)
    if text is None:
        return None, why
    try:
        claims = parse_checkpoint(text)
    except ContractError as exc:
        return None, str(exc)[:300]
    if len(claims) != 1 or claims[0].ref.uid != uid:
        return None, f"expected the one claim {uid}"
    return claims[0], ""


def _set_aside(path: Path, why: str) -> str:
    """Rename a damaged file (or directory) out of the way, keeping it for a person to look at."""
    aside = path.with_name(path.name + UNREADABLE)
    try:
        if aside.is_dir() and not aside.is_symlink():
            aside = path.with_name(f"{path.name}.{os.getpid()}{UNREADABLE}")
        os.replace(path, aside)
    except OSError as exc:
        return f"{path} unreadable ({why}) and not set aside ({exc.strerror}): skipped"
    return f"{path} unreadable ({why}); kept as {aside.name}"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
