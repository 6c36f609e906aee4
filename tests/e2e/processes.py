"""The processes a local cluster started, recorded in its state directory.

The cluster outlives the process that started it (``make demo`` returns to the shell), so each process is
recorded with its start time: stopping one later hits exactly it, never a process that reused its pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from tests.e2e.layout import ClusterError


class Processes:
    def __init__(self, *, state: Path, logs: Path, bin: Path) -> None:
        self.state = state
        self.logs = logs
        self.bin = bin
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: Sequence[Any], *, env: dict[str, str] | None = None) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        process = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "PATH": f"{self.bin}:{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
            },
            cwd=self.state,
            start_new_session=True,  # Ctrl-C in the shell that ran `make demo` must not reach the cluster
        )
        log.close()
        self._children[name] = process
        record = {"pid": process.pid, "created": psutil.Process(process.pid).create_time()}
        pids = self.state / "pids"
        pids.mkdir(exist_ok=True)
        (pids / name).write_text(json.dumps(record))
        time.sleep(0.2)
        if process.poll() is not None:
            raise ClusterError(f"{name} exited at once ({process.returncode}): see {self.logs / (name + '.log')}")

    def recorded(self) -> Iterator[tuple[str, psutil.Process]]:
        """The processes we started that still run: same pid *and* start time, so a reused pid is never hit."""
        pids = self.state / "pids"
        if not pids.is_dir():
            return
        for path in sorted(pids.iterdir()):
            record = json.loads(path.read_text())
            try:
                process = psutil.Process(record["pid"])
                if abs(process.create_time() - record["created"]) < 0.01 and process.status() != "zombie":
                    yield path.name, process
            except psutil.NoSuchProcess:
                continue

    def running(self) -> list[str]:
        return [name for name, _ in self.recorded()]

    def process(self, name: str) -> psutil.Process | None:
        """The running process this cluster started under ``name`` (kube-scheduler, etcd...), if any."""
        return next((process for recorded, process in self.recorded() if recorded == name), None)

    def stop(self, name: str, *, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> None:
        for recorded, process in self.recorded():
            if recorded == name:
                process.send_signal(sig)
                try:
                    process.wait(timeout)
                except psutil.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        child = self._children.pop(name, None)
        if child is not None:
            child.wait(10)
        (self.state / "pids" / name).unlink(missing_ok=True)

    def forget(self) -> None:
        """Drop the handles of children already stopped (after a tear-down)."""
        self._children.clear()
