"""``gpushared-extender``: the kube-scheduler extender (filter, prioritize, bind, inspect)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import click
import uvloop

from gpushared import __version__
from gpushared.cli import logs

if TYPE_CHECKING:
    from gpushared.extender.cache import ClusterCache

log = logging.getLogger("gpushared.extender")

ENV = "GPUSHARED_EXTENDER"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": ENV})
@click.version_option(__version__, prog_name="gpushared-extender")
@click.option("--address", default="0.0.0.0", show_default=True, help="Listen address.")
@click.option("--port", type=click.IntRange(1, 65535), default=39999, show_default=True, help="Listen port.")
@click.option("--prefix", default="/gpushare-scheduler", show_default=True, help="URL prefix of the verbs.")
@click.option("--policy", default="binpack", show_default=True, help="GPU placement policy: binpack, spread or fgd.")
@click.option("--resource-domain", default="aliyun.com", show_default=True, help="Domain of gpu-mem / gpu-count.")
@click.option("--kubeconfig", type=click.Path(path_type=Path), help="Kubeconfig; in-cluster credentials without it.")
@click.option("--tls-cert", type=click.Path(exists=True, path_type=Path), help="Serve HTTPS with this certificate.")
@click.option("--tls-key", type=click.Path(exists=True, path_type=Path), help="The certificate's private key.")
@click.option(
    "--client-ca",
    type=click.Path(exists=True, path_type=Path),
    help="Mutual TLS: the verbs answer only callers with a client certificate this CA signed (needs --tls-*).",
)
@click.option(
    "--client-name",
    "client_names",
    multiple=True,
    help="With --client-ca: only certificates with this common name or DNS name (repeatable; default: any).",
)
@click.option(
    "--public-pod-names/--no-public-pod-names",
    default=False,
    show_default=True,
    help="/inspect names pods to callers without a client certificate too.",
)
@click.option("--max-body-mib", type=click.IntRange(1, 1024), default=8, show_default=True, help="Request size limit.")
@click.option(
    "--max-nodes",
    type=click.IntRange(1, 1_000_000),
    default=15_000,
    show_default=True,
    help="The most candidate nodes one filter or prioritize may name.",
)
@click.option(
    "--leader-elect/--no-leader-elect", default=False, show_default=True, help="Only the Lease holder serves verbs."
)
@click.option("--lease-namespace", default="kube-system", show_default=True)
@click.option("--lease-name", default="gpushared-extender", show_default=True)
@click.option("--lease-seconds", type=click.FloatRange(2, 300), default=15.0, show_default=True, help="Lease duration.")
@click.option(
    "--identity", default=lambda: f"{socket.gethostname()}-{os.getpid()}", help="This replica's name in the Lease."
)
@click.option(
    "--advertise-address",
    help="Address the other replica reaches this one at (default: the listen address; in a pod, its IP).",
)
@click.option(
    "--watch-seconds",
    type=click.IntRange(5, 1800),
    default=60,
    show_default=True,
    help="Each watch is ended by the API server after this long; one silent for 10 s more is taken for dead.",
)
@click.option(
    "--binding-landing-seconds",
    type=click.FloatRange(1, 3600),
    default=120.0,
    show_default=True,
    help="How long a Binding whose answer was lost may still land: its memory stays reserved that long.",
)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
def main(
    *,
    address: str,
    port: int,
    prefix: str,
    policy: str,
    resource_domain: str,
    kubeconfig: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    client_ca: Path | None,
    client_names: tuple[str, ...],
    public_pod_names: bool,
    max_body_mib: int,
    max_nodes: int,
    leader_elect: bool,
    lease_namespace: str,
    lease_name: str,
    lease_seconds: float,
    identity: str,
    advertise_address: str | None,
    watch_seconds: int,
    binding_landing_seconds: float,
    log_level: str,
) -> None:
    """Scheduler extender for aliyun.com/gpu-mem. Every option also reads GPUSHARED_EXTENDER_<OPTION>."""
    from gpushared.contract import ContractError, ResourceNames
    from gpushared.core.placement import policy_named
    from gpushared.extender.cache import ClusterCache
    from gpushared.extender.scheduler import Scheduler
    from gpushared.extender.server import ServerConfig, build_app, serve
    from gpushared.kube.aioapi import AsyncApi
    from gpushared.kube.api import Api, KubeError, connect
    from gpushared.kube.lease import LeaderElector

    logs.configure(log_level)
    try:
        chosen = policy_named(policy)
    except ContractError as exc:
        raise click.BadParameter(exc.reason, param_hint="--policy") from None
    _check_tls(tls_cert=tls_cert, tls_key=tls_key, client_ca=client_ca, where=f"{address}:{port}")
    try:
        api = Api(connect(kubeconfig))
        binder = AsyncApi(api.client.configuration)
    except KubeError as exc:
        raise click.ClickException(str(exc)) from None
    resources = ResourceNames(domain=resource_domain)
    cache = ClusterCache(
        list_nodes=api.core.list_node,
        list_pods=api.core.list_pod_for_all_namespaces,
        resources=resources,
        watch_seconds=watch_seconds,
        landing_seconds=binding_landing_seconds,
    )
    own_url = f"{'https' if tls_cert else 'http'}://{advertise_address or address}:{port}"
    elector = (
        LeaderElector(
            api.client,
            namespace=lease_namespace,
            name=lease_name,
            identity=f"{identity} {own_url}",
            lease_seconds=lease_seconds,
            renew_deadline=lease_seconds * 2 / 3,
            retry_seconds=lease_seconds / 7.5,
        )
        if leader_elect
        else None
    )

    prepared = threading.Event()

    def ready() -> tuple[bool, str]:
        if not prepared.is_set():
            return False, "the cache has not synced with the API server yet"
        return True, ""

    def leader() -> str | None:
        """Serve here when leading (or not electing); else the leader's URL, from its Lease identity."""
        if elector is None or elector.leading:
            return None
        holder = elector.holder.rsplit(" ", 1)
        return holder[1] if len(holder) == 2 and holder[1].startswith(("http://", "https://")) else ""

    config = ServerConfig(
        address=address,
        port=port,
        prefix=prefix,
        max_body_bytes=max_body_mib * 2**20,
        max_nodes=max_nodes,
        tls_cert=tls_cert,
        tls_key=tls_key,
        client_ca=client_ca,
        client_names=frozenset(client_names),
        public_pod_names=public_pod_names,
    )
    app = build_app(
        Scheduler(cache=cache, api=binder, policy=chosen, resources=resources),
        config,
        ready=ready,
        leader=leader,
    )
    cache.start()
    threading.Thread(target=_prepare_when_synced, args=(cache, prepared), name="prepare", daemon=True).start()
    if elector is not None:
        elector.start()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve(app, config, stop=stop)

    try:
        # uvloop: each filter and bind is a few event-loop turns over sockets, and uvloop's turns cost less
        # (11-18 % less extender CPU per filter+bind at 2,500 nodes, docs/benchmarks.md)
        uvloop.run(run())
    finally:
        if elector is not None:
            elector.stop()
        cache.stop()


def _check_tls(*, tls_cert: Path | None, tls_key: Path | None, client_ca: Path | None, where: str) -> None:
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if client_ca is not None and tls_cert is None:
        raise click.UsageError("--client-ca needs --tls-cert and --tls-key: client certificates come with TLS")
    from gpushared.extender.server import ServerConfig, tls_context

    try:  # a certificate, key or CA that does not load: say which, before anything starts
        tls_context(ServerConfig(tls_cert=tls_cert, tls_key=tls_key, client_ca=client_ca))
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise click.ClickException(f"TLS: {exc}") from None
    if client_ca is None:
        log.warning(
            "no --client-ca: anyone who reaches %s may filter and bind pods; see docs/install.md (mutual TLS)",
            where,
        )


def _prepare_when_synced(cache: ClusterCache, prepared: threading.Event) -> None:
    """Once the first sync is done: warm the cache, keep what it holds out of the garbage collector's
    walks, and only then say ready.

    Cached pods live as long as their pods do, and 150k of them are about a million tracked objects: every
    full collection would walk them all, a pause of tens of milliseconds in the middle of some filter.
    Frozen, they are still freed by reference counting when the watch drops them (they hold no cycles)."""
    if cache.nodes.wait_synced(SYNC_WAIT_SECONDS) and cache.pods.wait_synced(SYNC_WAIT_SECONDS):
        cache.warm()
        gc.freeze()
        log.info("cache synced; %d objects kept out of the garbage collector's walks", gc.get_freeze_count())
        prepared.set()


#: How long the startup thread waits for the first sync; a cache that never syncs never serves either.
SYNC_WAIT_SECONDS = 24 * 3600.0


if __name__ == "__main__":
    main()
