"""How the daemon ends when it cannot go on: what the CLI turns into an exit status for systemd."""

from __future__ import annotations


class FatalError(Exception):
    """Stop with this message: retrying cannot help (bad node name, device list too large)."""


class RestartNeeded(Exception):
    """Exit for systemd to start the unit again: only a new start fixes this (exit status 75, EX_TEMPFAIL)."""
