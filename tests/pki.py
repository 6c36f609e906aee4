"""A throwaway certificate authority for tests (openssl): server and client certificates it signs."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


class Authority:
    def __init__(self, directory: Path, name: str = "test-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.cert, self.key = directory / f"{name}.crt", directory / f"{name}.key"
        self._openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
            "-keyout", self.key, "-out", self.cert,
        )  # fmt: skip

    def issue(self, name: str, *, common_name: str, server: bool = False) -> Pair:
        """A certificate for ``common_name``: for serving on 127.0.0.1 (and as a client), or a client only."""
        pair = Pair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        csr = self.directory / f"{name}.csr"
        self._openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={common_name}", "-keyout", pair.key, "-out", csr
        )
        extensions = self.directory / f"{name}.ext"
        usage = "serverAuth,clientAuth" if server else "clientAuth"
        alt = f"subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:{common_name}\n" if server else ""
        extensions.write_text(f"extendedKeyUsage={usage}\n{alt}")
        self._openssl(
            "x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key, "-CAcreateserial", "-days", "2",
            "-extfile", extensions, "-out", pair.cert,
        )  # fmt: skip
        return pair

    def _openssl(self, *args: object) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, cwd=self.directory)
