"""``gpushared``: the node daemon (device plugin, GPU inventory, MPS)."""

from __future__ import annotations

import click

from gpushared import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpushared")
def main() -> None:
    """gpushared node daemon: the kubelet device plugin for aliyun.com/gpu-mem."""


@main.command()
def version() -> None:
    """Print the version."""
    click.echo(__version__)


@main.command()
def serve() -> None:
    """Run the device plugin (not yet: the node daemon arrives with issue #3)."""
    raise click.ClickException("not yet: the node daemon is being built (issue #3)")
