"""``gpushared-extender``: the kube-scheduler extender (filter, prioritize, bind, inspect)."""

from __future__ import annotations

import logging
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpushared import __version__
from gpushared.cli import logs
from gpushared.contract import dra

if TYPE_CHECKING:
    from gpushared.core.placement.mixbook import ExpectedMix

log = logging.getLogger("gpushared.extender")

ENV = "GPUSHARED_EXTENDER"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": ENV})
@click.version_option(__version__, prog_name="gpushared-extender")
@click.option("--address", default="0.0.0.0", show_default=True, help="Listen address.")
@click.option("--port", type=click.IntRange(1, 65535), default=39999, show_default=True, help="Listen port.")
@click.option("--prefix", default="/gpushare-scheduler", show_default=True, help="URL prefix of the verbs.")
@click.option(
    "--policy",
    default="fgd",
    show_default=True,
    help="fgd, binpack (Aliyun's placement within a node), spread or balanced.",
)
@click.option("--resource-domain", default="aliyun.com", show_default=True, help="Domain of gpu-mem / gpu-count.")
@click.option(
    "--gpu-model-label",
    default="nvidia.com/gpu.product",
    show_default=True,
    help="Node label naming the GPU model; fgd weighs which models pods' node affinity on it allows ('' ignores it).",
)
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
@click.option(
    "--insecure-bind/--no-insecure-bind",
    default=False,
    show_default=True,
    help="Without --client-ca, answer bind anyway: anyone who reaches the port can then bind pods "
    "(benchmarks on loopback only). Without either, bind answers 403.",
)
@click.option(
    "--webhook-scheduler",
    default="gpushared-scheduler",
    show_default=True,
    help="The scheduler <prefix>/mutate sends new pods that ask for GPU memory to (docs/install.md, managed clusters).",
)
@click.option(
    "--tls-reload-seconds",
    type=click.FloatRange(0.1, 3600),
    default=10.0,
    show_default=True,
    help="How often the certificate, key and client CA files are read for a change; a changed set that loads "
    "is served from the next connection on, without a restart.",
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
    "--rank-in-filter/--no-rank-in-filter",
    default=True,
    show_default=True,
    help="Filter keeps only the nodes the policy ranks best, so kube-scheduler makes the policy's choice "
    "without prioritizeVerb: deploy/'s wiring, and Aliyun's (filter and bind only). --no-rank-in-filter: "
    "filter passes every node that fits, for a scheduler that must choose among them itself (another "
    "extender after this one; prioritizeVerb then wired for the ranking; docs/install.md).",
)
@click.option(
    "--expected-mix",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),  # and a regular file (_expected)
    help="JSON file of the pod kinds expected and their counts (`kubectl inspect gpushare --expected-mix` "
    "writes one): fgd and binpack count it beside the pods seen, so a fresh extender keeps room for kinds "
    "it has not yet seen (docs/extender.md).",
)
@click.option(
    "--claim-allocator/--no-claim-allocator",
    default=False,
    show_default=True,
    help="Place DRA claims of gpushared's DeviceClass with --policy (Kubernetes 1.34+; docs/dra.md): the "
    "webhook gates new pods that use them and the leader allocates their claims, then removes the gate. Needs "
    "the webhook; kube-scheduler need not call the extender's verbs.",
)
@click.option(
    "--claim-handover-after",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds a gated pod may wait for the claim allocator before its gate is removed with no allocation, "
    "leaving it to kube-scheduler's first fit (counted, logged, and told in an Event). Unset: pods wait.",
)
@click.option(
    "--steer-cpu-pods/--no-steer-cpu-pods",
    default=False,
    show_default=True,
    help="Steer pods that ask for no GPU off idle GPUs where kube-scheduler calls no extender (docs/dra.md, "
    '"Steering CPU-only pods"): <prefix>/mutate-steer gates new ones in the namespaces its webhook selects, '
    "and the leader gives each a preferred node affinity for the nodes prioritize-no-gpu ranks best, then "
    "removes the gate.",
)
@click.option(
    "--max-evictions-per-minute",
    type=click.IntRange(0, 10_000),
    default=20,
    show_default=True,
    help="The most pods preemption evicts a minute for the GPU pods of one namespace (the preempt verb answers "
    "no node past it, and the preemptor waits): one tenant's high-priority pods cannot churn the others' "
    "without end. 0: GPU pods preempt nothing.",
)
@click.option("--dra-driver", default=dra.DRIVER, show_default=True, help="The DRA driver's name.")
@click.option("--dra-device-class", default=dra.DEVICE_CLASS, show_default=True, help="gpushared's DeviceClass.")
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
    gpu_model_label: str,
    kubeconfig: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    client_ca: Path | None,
    client_names: tuple[str, ...],
    public_pod_names: bool,
    insecure_bind: bool,
    webhook_scheduler: str,
    tls_reload_seconds: float,
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
    rank_in_filter: bool,
    expected_mix: Path | None,
    claim_allocator: bool,
    claim_handover_after: float | None,
    steer_cpu_pods: bool,
    max_evictions_per_minute: int,
    dra_driver: str,
    dra_device_class: str,
    log_level: str,
) -> None:
    """Scheduler extender for aliyun.com/gpu-mem. Every option also reads GPUSHARED_EXTENDER_<OPTION>."""
    from gpushared.contract import ContractError, ResourceNames
    from gpushared.core.placement.policies import policy_named
    from gpushared.extender import app
    from gpushared.extender.claims.allocator import AllocatorSettings
    from gpushared.extender.http.config import ServerConfig
    from gpushared.kube.aioapi import AsyncApi
    from gpushared.kube.api import Api, KubeError, connect

    logs.configure(log_level)
    try:
        chosen = policy_named(policy)
    except ContractError as exc:
        raise click.BadParameter(exc.reason, param_hint="--policy") from None
    expected = _expected(expected_mix)
    _check_tls(
        tls_cert=tls_cert, tls_key=tls_key, client_ca=client_ca, insecure_bind=insecure_bind, where=f"{address}:{port}"
    )
    try:
        api = Api(connect(kubeconfig))
        binder = AsyncApi(api.rest.credentials)
    except KubeError as exc:
        raise click.ClickException(str(exc)) from None
    server = ServerConfig(
        address=address,
        port=port,
        prefix=prefix,
        max_body_bytes=max_body_mib * 2**20,
        max_nodes=max_nodes,
        tls_cert=tls_cert,
        tls_key=tls_key,
        client_ca=client_ca,
        client_names=frozenset(client_names),
        tls_reload_seconds=tls_reload_seconds,
        public_pod_names=public_pod_names,
        insecure_bind=insecure_bind,
    )
    lease = app.LeaseSettings(namespace=lease_namespace, name=lease_name, identity=identity, seconds=lease_seconds)
    settings = app.ExtenderSettings(
        server=server,
        policy=chosen,
        resources=ResourceNames(domain=resource_domain),
        lease=lease if leader_elect else None,
        advertise_address=advertise_address,
        watch_seconds=watch_seconds,
        binding_landing_seconds=binding_landing_seconds,
        model_label=gpu_model_label,
        rank_in_filter=rank_in_filter,
        webhook_scheduler=webhook_scheduler,
        expected=expected,
        claims=AllocatorSettings(
            policy=chosen,
            driver=dra_driver,
            device_class=dra_device_class,
            handover_after=claim_handover_after,
            model_label=gpu_model_label,
        )
        if claim_allocator
        else None,
        steer=steer_cpu_pods,
        max_evictions_per_minute=max_evictions_per_minute,
    )
    app.run(settings, api=api, binder=binder)


def _expected(path: Path | None) -> ExpectedMix | None:
    """The operator's expected mix, or a usage error naming the file and what in it is wrong."""
    if path is None:
        return None
    import json

    from gpushared.contract import ContractError
    from gpushared.core.placement.mixbook import read_expected_mix

    try:
        # Opened without waiting (a FIFO's writer may never come), then held to a regular file: a FIFO, a
        # device or a directory is refused at once, not read forever or past the limit.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as stream:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise click.BadParameter(f"{path}: not a regular file", param_hint="--expected-mix")
            text = stream.read(MAX_EXPECTED_BYTES + 1)
        if len(text) > MAX_EXPECTED_BYTES:
            raise click.BadParameter(f"{path}: over {MAX_EXPECTED_BYTES // 2**20} MiB", param_hint="--expected-mix")
        expected = read_expected_mix(json.loads(text), key=str(path))
    except (OSError, ValueError, RecursionError) as exc:  # ContractError and JSONDecodeError are ValueErrors
        reason = str(exc) if isinstance(exc, ContractError) else f"{path}: {exc}"
        raise click.BadParameter(reason, param_hint="--expected-mix") from None
    log.info("expected mix: %d kinds of pod, counted as %g pods (%s)", len(expected.shares), expected.weight, path)
    return expected


#: An expected mix lists some hundreds of kinds; a file far past that is not one.
MAX_EXPECTED_BYTES = 16 * 2**20


def _check_tls(
    *, tls_cert: Path | None, tls_key: Path | None, client_ca: Path | None, insecure_bind: bool, where: str
) -> None:
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if client_ca is not None and tls_cert is None:
        raise click.UsageError("--client-ca needs --tls-cert and --tls-key: client certificates come with TLS")
    from gpushared.extender.http.config import ServerConfig
    from gpushared.extender.http.tls import server_context

    try:  # a certificate, key or CA that does not load: say which, before anything starts
        server_context(ServerConfig(tls_cert=tls_cert, tls_key=tls_key, client_ca=client_ca))
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise click.ClickException(f"TLS: {exc}") from None
    if client_ca is None and insecure_bind:
        log.warning(
            "no --client-ca and --insecure-bind: anyone who reaches %s may bind pods; see docs/install.md (mutual TLS)",
            where,
        )
    elif client_ca is None:
        log.error(
            "no --client-ca: bind answers 403 to everyone (kube-scheduler included) until the extender has "
            "client authentication; see docs/install.md (mutual TLS)"
        )


if __name__ == "__main__":
    main()
