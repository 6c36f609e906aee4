"""``gpushared-extender``: the kube-scheduler extender (filter, prioritize, bind)."""

from __future__ import annotations

import click

from gpushared import __version__


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpushared-extender")
def main() -> None:
    """Scheduler extender for aliyun.com/gpu-mem (not yet: it arrives with issue #4)."""
    raise click.ClickException("not yet: the scheduler extender is being built (issue #4)")
