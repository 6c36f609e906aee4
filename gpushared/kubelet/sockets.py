"""The kubelet's gRPC sockets as the plugins serve them: unix sockets only root can open (whoever talks to
them is handed GPUs)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc


def serve_root_only(server: grpc.Server, path: Path) -> None:
    """Start ``server`` on the unix socket ``path``, mode 0600 from its creation on."""
    previous = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix://{path}")
        server.start()
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
