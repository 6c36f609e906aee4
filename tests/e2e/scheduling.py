"""The local cluster's scheduling: the gpushared extender as a process (mutual TLS with the cluster's CA,
or certificates an operator's guide made) and kube-scheduler wired to it as deploy/ ships the wiring."""

from __future__ import annotations

import json
import signal
import ssl
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tests.builders import scheduler_config
from tests.e2e import versions
from tests.e2e.layout import NODE, wait_for

if TYPE_CHECKING:
    from tests.e2e.cluster import LocalCluster


class Scheduling:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        #: where the extender's and kube-scheduler's certificates are (ca.crt, extender.*, scheduler.*): the
        #: cluster's own CA, or a directory scripts/extender-certs wrote, as an operator's guide has it
        self.extender_certs = cluster.state / "pki"
        #: the extender on plain HTTP (``restart_extender(plain=True)``; benchmarks only)
        self.extender_plain = False

    # --- the extender -----------------------------------------------------------------------------------------

    def start_extender(self, *extra: str) -> None:
        c = self.cluster
        pki = self.extender_certs
        tls = ["--insecure-bind"] if self.extender_plain else [
            "--tls-cert", pki / "extender.crt",
            "--tls-key", pki / "extender.key",
            "--client-ca", pki / "ca.crt",
            "--client-name", "system:kube-scheduler",
            "--client-name", "gpushared-extender",
        ]  # fmt: skip
        c.processes.spawn(
            "gpushared-extender",
            [
                sys.executable, "-m", "gpushared.cli.extender",
                "--address", "127.0.0.1",
                "--port", c.ports.extender,
                "--kubeconfig", c.kubeconfig_for("gpushared-extender"),
                "--leader-elect",
                "--lease-seconds", "4",
                # After a restart binds wait while a pending pod's Binding may still land (the fence, design.md
                # §8); the loopback API server here holds none, so a short window keeps restarts cheap, as
                # the fault suite's 12 s does.
                "--binding-landing-seconds", "20",
                *tls,
                *extra,
            ],
        )  # fmt: skip
        wait_for(self.extender_ready, timeout=30, what="gpushared-extender /readyz")

    @property
    def extender_url(self) -> str:
        scheme = "http" if self.extender_plain else "https"
        return f"{scheme}://127.0.0.1:{self.cluster.ports.extender}"

    def extender_tls(self, *, client: bool = False) -> ssl.SSLContext:
        """Trusting the extender's certificate; with ``client``, presenting one it takes (its own)."""
        pki = self.extender_certs
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        if client:
            context.load_cert_chain(str(pki / "extender.crt"), str(pki / "extender.key"))
        return context

    def extender_ready(self) -> bool:
        try:
            url = f"{self.extender_url}/readyz"
            with urllib.request.urlopen(url, timeout=2, context=self.extender_tls()) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def restart_extender(self, *args: str, kill: bool = False, certs: Path | None = None, plain: bool = False) -> None:
        """Stop the extender process and start it again, with the certificates in ``certs`` if given, and
        ``args`` added to its command line (``--policy balanced``) until it restarts again. ``plain``: on
        plain HTTP, no TLS, and kube-scheduler wired to it so from its next start; only for
        scripts/bench_scheduler.py to measure what TLS costs (anyone on the host could bind pods)."""
        self.cluster.processes.stop("gpushared-extender", sig=signal.SIGKILL if kill else signal.SIGTERM)
        self.extender_certs = certs or self.extender_certs
        self.extender_plain = plain
        self.start_extender(*args)

    def extender_metrics(self) -> str:
        """The extender's /metrics page, asked with a client certificate it takes."""
        url = f"{self.extender_url}/metrics"
        with urllib.request.urlopen(url, timeout=10, context=self.extender_tls(client=True)) as response:
            return str(response.read().decode())

    def extender_inspect(self, node: str = NODE) -> dict[str, Any]:
        """The extender's own view of a node (its cache), not the API's."""
        url = f"{self.extender_url}/gpushare-scheduler/inspect/{node}"
        with urllib.request.urlopen(url, timeout=5, context=self.extender_tls(client=True)) as response:
            [report] = json.load(response)["nodes"]
            return report  # type: ignore[no-any-return]

    # --- kube-scheduler ---------------------------------------------------------------------------------------

    def start_scheduler(
        self,
        *,
        extenders: bool = True,
        adjust: Callable[[dict[str, Any]], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        c = self.cluster
        p = c.ports
        version = c.version("kube-scheduler")
        chosen = versions.scheduler_api(version)
        config = chosen.document(
            extenders=self._extenders(chosen.shipped) if extenders else [],
            kubeconfig=str(c.kubeconfig_for("admin")),
            health=f"127.0.0.1:{p.scheduler_health}",
        )
        if adjust is not None:
            adjust(config)
        (c.state / "scheduler.yaml").write_text(yaml.safe_dump(config))
        c.processes.spawn(
            "kube-scheduler",
            [
                c.bin / "kube-scheduler",
                "--config", c.state / "scheduler.yaml",
                "--bind-address", "127.0.0.1",
                "--secure-port", p.scheduler,
                *versions.insecure_port_flags(version),
                *versions.feature_gate_flags(version),
                *versions.scheduler_auth_flags(version, kubeconfig=str(c.kubeconfig_for("admin"))),
            ],
            env=env,
        )  # fmt: skip

    def restart_scheduler(
        self,
        *,
        extenders: bool = True,
        adjust: Callable[[dict[str, Any]], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """kube-scheduler again; without ``extenders``, as a managed cluster's: stock, knowing no extender.
        ``adjust`` may change the KubeSchedulerConfiguration document before it is written (a benchmark's
        variant: no prioritize, another ``percentageOfNodesToScore``); ``env`` is added to its environment
        (``DISABLE_HTTP2``)."""
        self.cluster.processes.stop("kube-scheduler")
        self.start_scheduler(extenders=extenders, adjust=adjust, env=env)

    def scheduler_metrics(self) -> str:
        """kube-scheduler's /metrics page."""
        return self.scheduler_get("/metrics", timeout=10).decode()

    def scheduler_get(self, path: str, *, timeout: float) -> bytes:
        """A page of kube-scheduler's debugging server (/metrics, /debug/pprof/...): from the plain-HTTP
        address while its configuration has one (v1beta1, 1.20), else from its secure port as the admin
        (delegated to the API server: ``versions.scheduler_auth_flags``; its serving certificate is
        self-signed)."""
        c = self.cluster
        if versions.scheduler_api(c.version("kube-scheduler")).bind_addresses:
            request = urllib.request.Request(f"http://127.0.0.1:{c.ports.scheduler_health}{path}")
            context = None
        else:
            request = urllib.request.Request(
                f"https://127.0.0.1:{c.ports.scheduler}{path}",
                headers={"Authorization": f"Bearer {c.tokens['admin']}"},
            )
            context = ssl.create_default_context()
            context.check_hostname = False  # loopback, and the scheduler's own self-signed certificate
            context.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return bytes(response.read())

    def _extenders(self, shipped: Path) -> list[dict[str, Any]]:
        """The shipped file's extenders with this cluster's address and certificate paths, and the opt-in
        entry for pods without GPU uncommented (a test scores it)."""
        extenders = scheduler_config(shipped, no_gpu_scoring=True)["extenders"]
        pki = self.extender_certs
        for extender in extenders:
            extender["urlPrefix"] = f"{self.extender_url}/gpushare-scheduler"
            if self.extender_plain:
                extender["enableHTTPS"] = False
                extender.pop("tlsConfig", None)
                continue
            extender["tlsConfig"] = {
                "certFile": str(pki / "scheduler.crt"),
                "keyFile": str(pki / "scheduler.key"),
                "caFile": str(pki / "ca.crt"),
            }
        return list(extenders)
