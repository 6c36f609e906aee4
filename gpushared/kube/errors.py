"""What a Kubernetes call can fail with: callers act on the HTTP status, and show the message as it is."""

from __future__ import annotations

from gpushared.kube import jsonio


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP status, or None when the server was not reached."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFound(KubeError):
    """404: the object does not exist (any more)."""


class Conflict(KubeError):
    """409: the object changed since it was read (a resourceVersion-guarded write lost), or already exists."""


class NoCredentials(KubeError):
    """Nothing to authenticate with yet; unlike a broken kubeconfig, this one may go away by itself."""


def error_for(message: str, status: int | None) -> KubeError:
    """The KubeError for an HTTP status: NotFound and Conflict are the ones callers act on."""
    kind = {404: NotFound, 409: Conflict}.get(status or 0, KubeError)
    return kind(message, status=status)


def status_message(body: bytes | str | None, reason: str | None) -> str:
    """The message of the Status an API server answered an error with, else the HTTP reason."""
    try:
        return str(jsonio.loads(body or b"{}").get("message") or reason)
    except (TypeError, ValueError, AttributeError, jsonio.JSONDecodeError):
        return str(reason)
