"""``gpushared``: the node daemon (device plugin, GPU inventory), and ``gpushared status``."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from gpushared import __version__
from gpushared.cli import logs
from gpushared.core.placement.report import LINK_LEGEND, link_matrix_lines
from gpushared.daemon import config as config_module

CONFIG_HELP = f"YAML configuration (default {config_module.DEFAULT_PATH}); GPUSHARED_* variables override it."
#: EX_TEMPFAIL: systemd (Restart=on-failure) starts the unit again; status 2 (a bad configuration) it does not.
EXIT_RESTART = 75


def _load(config_path: Path | None, flags: dict[str, Any]) -> config_module.Config:
    try:
        return config_module.load(
            config_path or config_module.DEFAULT_PATH, flags=flags, required=config_path is not None
        )
    except config_module.ConfigError as exc:
        raise click.ClickException(f"bad configuration: {exc}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpushared")
def main() -> None:
    """gpushared node daemon: the kubelet device plugin for aliyun.com/gpu-mem."""


@main.command()
def version() -> None:
    """Print the version."""
    click.echo(__version__)


@main.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help=CONFIG_HELP)
@click.option("--node-name", help="This machine's Node name (default: the hostname).")
@click.option("--kubeconfig", type=click.Path(path_type=Path), help="Kubeconfig of the node's identity.")
@click.option("--memory-unit", type=click.Choice(["GiB", "MiB"]), help="One gpu-mem unit.")
@click.option("--kubelet-dir", type=click.Path(path_type=Path), help="The kubelet's root (device-plugins/ inside).")
@click.option("--log-level", type=click.Choice(config_module.LOG_LEVELS), help="Log verbosity.")
@click.option("--metrics-address", help="Where metrics and status listen (default 0.0.0.0; :: for IPv6).")
@click.option("--metrics-port", type=int, help="DaemonMetrics and status port; 0 turns them off.")
def serve(config_path: Path | None, **flags: Any) -> None:
    """Run the daemon until SIGTERM; SIGHUP re-reads the configuration."""
    from gpushared.daemon.errors import FatalError, RestartNeeded
    from gpushared.daemon.service import Service
    from gpushared.nvml.backend import NvmlBackend

    config = _load(config_path, flags)
    logs.configure(config.log_level)
    service = Service(config, backend=NvmlBackend(driver_root=str(config.driver_root)), config_path=config_path)
    service.install_signals()
    try:
        service.run()
    except FatalError as exc:
        logging.getLogger("gpushared").critical("%s", exc)
        raise SystemExit(2) from None
    except RestartNeeded as exc:
        logging.getLogger("gpushared").error("%s", exc)
        raise SystemExit(EXIT_RESTART) from None


@main.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's status as JSON.")
def status(config_path: Path | None, as_json: bool) -> None:
    """Show the running daemon's GPUs, their health and who holds them."""
    from gpushared.daemon.endpoints import get_local

    config = _load(config_path, {})
    # The local socket answers with names (root only); the TCP port, as anyone may ask it, without them
    # unless metrics.podNames is on.
    socket_path = config.metrics_socket
    if socket_path is not None and socket_path.exists():
        try:
            body = json.loads(get_local(socket_path, "/status"))
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"the daemon does not answer at {socket_path}: {exc}") from None
    else:
        host = "127.0.0.1" if config.metrics_address in ("0.0.0.0", "::") else config.metrics_address
        url = f"http://{f'[{host}]' if ':' in host else host}:{config.metrics_port}/status"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.load(response)
        except (urllib.error.URLError, OSError) as exc:
            raise click.ClickException(f"the daemon does not answer at {url}: {exc}") from None
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    click.echo(render_status(body))


@main.group()
def mps() -> None:
    """The MPS control daemons (one per GPU; they keep running when gpushared stops)."""


@mps.command("stop")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help=CONFIG_HELP)
@click.option("--gpu", help="Only this GPU (UUID or NVML index); default: every GPU.")
def mps_stop(config_path: Path | None, gpu: str | None) -> None:
    """Quit MPS control daemons on purpose. Their clients lose the GPU; gpushared does not restart them
    until `gpushared mps start`."""
    _mps_each(config_path, gpu, stop=True)


@mps.command("start")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help=CONFIG_HELP)
@click.option("--gpu", help="Only this GPU (UUID or NVML index); default: every GPU.")
def mps_start(config_path: Path | None, gpu: str | None) -> None:
    """Let gpushared start MPS control daemons stopped with `gpushared mps stop` again."""
    _mps_each(config_path, gpu, stop=False)


@mps.command("prepare")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help=CONFIG_HELP)
def mps_prepare(config_path: Path | None) -> None:
    """Mount each GPU's MPS shm tmpfs in the host's mount namespace (the systemd unit runs this before
    the sandboxed daemon starts, since mounts made inside its sandbox are hidden from the kubelet)."""
    from gpushared.daemon import mps as mps_module
    from gpushared.mps.control import MpsError
    from gpushared.nvml.backend import GpuBackendError, NvmlBackend

    config = _load(config_path, {})
    if not config.mps_enabled:
        click.echo("MPS is off (mps.enabled): nothing to prepare")
        return
    backend = NvmlBackend(driver_root=str(config.driver_root))
    try:
        for line in mps_module.prepare_mounts(mps_module.settings_of(config), backend=backend):
            click.echo(line)
    except GpuBackendError as exc:
        click.echo(f"no GPUs to prepare: {exc}")  # the daemon reports it too, and waits for NVML
    except MpsError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        backend.stop()


def _mps_each(config_path: Path | None, gpu: str | None, *, stop: bool) -> None:
    from gpushared.daemon import mps as mps_module
    from gpushared.mps.control import MpsError
    from gpushared.nvml.backend import GpuBackendError, NvmlBackend

    config = _load(config_path, {})
    settings = mps_module.settings_of(config)
    backend = NvmlBackend(driver_root=str(config.driver_root))
    try:
        for uuid in mps_module.daemon_uuids(settings, gpu=gpu, backend=backend):
            if stop:
                click.echo(mps_module.stop_daemon(settings, uuid, backend=backend))
            else:
                click.echo(mps_module.resume_daemon(settings, uuid))
    except (MpsError, GpuBackendError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        backend.stop()


def render_status(body: dict[str, Any]) -> str:
    unit = body["unit"]
    dra = body.get("mode") == "dra"
    watching = ", slice published" if dra else ", devices read"
    lines = [
        f"node {body['node']}  "
        + (f"DRA driver ({body.get('driver', 'gpu.gpushared.io')})" if dra else f"resource {body['resource']}")
        + "  kubelet: "
        + ("NOT registered" if not body["registered"] else "registered")
        + (watching if body["kubeletWatching"] else ", not serving yet" if body["registered"] else "")
        + ("" if body["nvml"] else "  NVML: unavailable"),
        f"state: {body['state']}",
        "",
        f"{'GPU':<4}{'UUID':<42}{'MODEL':<24}{'USED/TOTAL (' + unit + ')':<20}HEALTH",
    ]
    for gpu in body["gpus"]:
        health = "healthy" if gpu["healthy"] else f"UNHEALTHY ({gpu['problem']})"
        used = f"{gpu['used']}/{gpu['memory']}"
        uuid = gpu.get("uuid") or "(hidden)"
        lines.append(f"{gpu['index']:<4}{uuid:<42}{gpu['model'][:23]:<24}{used:<20}{health}")
    if body.get("links"):
        indices = [gpu["index"] for gpu in body["gpus"]]
        numa = [gpu.get("numa") for gpu in body["gpus"]]
        lines += ["", *link_matrix_lines(indices, body["links"], numa), LINK_LEGEND]
    if isinstance(body["pods"], int):  # the TCP port's answer to anyone: counted, not named
        lines += ["", f"{body['pods']} pods hold GPU memory; {body.get('names', 'names hidden')}"]
    elif body["pods"]:
        lines += ["", f"{'POD':<40}{'GPU(' + unit + ')':<16}{'ASSIGNED':<10}CONTAINERS"]
        for pod in body["pods"]:
            gpus = ", ".join(f"{i}:{a}" for i, a in pod["gpus"].items()) or f"pending:{pod['pending']}"
            containers = ", ".join(f"{c}->GPU {','.join(map(str, gpus))}" for c, gpus in pod["containers"].items())
            lines.append(
                f"{pod['namespace'] + '/' + pod['name']:<40}{gpus:<16}{str(pod['assigned']).lower():<10}{containers}"
            )
            if pod.get("problem"):
                lines.append(f"    problem: {pod['problem']}")
    claims = body.get("claims")
    if isinstance(claims, int):
        lines += ["", f"{claims} DRA claims prepared; {body.get('names', 'names hidden')}"]
    elif claims:
        lines += ["", f"{'CLAIM':<40}{'REQUEST':<12}{'GPU':<5}{'MEMORY(' + unit + ')':<14}{'COMPUTE %':<11}MPS"]
        for claim in claims:
            for device in claim["devices"]:
                name = f"{claim['namespace']}/{claim['name']}"
                lines.append(
                    f"{name:<40}{device['request']:<12}{device['gpu']:<5}{device['memory']:<14}"
                    f"{device['compute']:<11}{'yes' if device['mps'] else 'no'}"
                )
    if body.get("mps"):
        lines += ["", f"{'MPS':<4}{'PID':<9}{'STATE':<10}{'CLIENTS':<9}{'RESTARTS':<10}{'DEFAULT LIMITS':<24}PIPE"]
        for daemon in body["mps"]:
            limits = daemon["limits"]
            shown = f"{limits.get('threads', '?')}% / {limits.get('memory', '?')}" if limits else "-"
            clients = "-" if daemon["clients"] is None else str(daemon["clients"])
            state = daemon["state"] + (" (adopted)" if daemon["adopted"] else "")
            lines.append(
                f"{daemon['gpu']:<4}{daemon['pid'] or '-':<9}{state:<10}{clients:<9}{daemon['restarts']:<10}"
                f"{shown:<24}{daemon['pipe']}"
            )
            if daemon["problem"]:
                lines.append(f"    problem: {daemon['problem']}")
    memory = body.get("memory")
    if memory and (memory["containers"] or memory["hostProcesses"]):
        lines += ["", f"{'CONTAINER':<48}{'GPU':<5}{'USED/ALLOCATED (MiB)':<22}PIDS"]
        for usage in memory["containers"]:
            name = f"{usage['namespace']}/{usage['pod']}/{usage['container']}"
            amounts = f"{usage['usedMiB']}/{usage['allocatedMiB']}"
            over = "  OVER" if usage["usedMiB"] > usage["allocatedMiB"] else ""
            pids = ",".join(map(str, usage["pids"]))
            lines.append(f"{name:<48}{usage['gpu']:<5}{amounts + over:<22}{pids}")
        for gpu, processes in memory["hostProcesses"].items():
            for process in processes:
                lines.append(f"{'(no pod) pid ' + str(process['pid']):<48}{gpu:<5}{process['usedMiB']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
