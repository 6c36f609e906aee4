"""``kubectl inspect gpushare``: which pod uses which GPU, cluster-wide."""

from __future__ import annotations

import click

from gpushared import __version__


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kubectl-inspect-gpushare")
@click.option("-d", "--details", is_flag=True, help="Show every pod per GPU.")
@click.argument("node", required=False)
def main(details: bool, node: str | None) -> None:
    """Show GPU memory allocation per node and GPU (not yet: it arrives with issue #4)."""
    raise click.ClickException("not yet: kubectl inspect gpushare is being built (issue #4)")
