"""systemd's side of sd_notify: a datagram socket that records what a service tells it, with times."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, str]] = []  # (monotonic time, one KEY=value line)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            with self._cond:
                self.messages += [(now, line) for line in data.decode().splitlines() if line]
                self._cond.notify_all()

    def wait_for(self, line: str, *, timeout: float = 15) -> float:
        """When ``line`` (or a line starting with it, for "STATUS=") first arrived."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for at, seen in self.messages:
                    if seen == line or (line.endswith("=") and seen.startswith(line)):
                        return at
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {line!r} from the service; got {[m for _, m in self.messages][-10:]}")
                self._cond.wait(remaining)

    def lines(self, prefix: str = "") -> list[str]:
        with self._cond:
            return [m for _, m in self.messages if m.startswith(prefix)]

    def times(self, line: str) -> list[float]:
        with self._cond:
            return [at for at, m in self.messages if m == line]

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)
