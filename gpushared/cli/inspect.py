"""``kubectl inspect gpushare``: which pod uses which GPU, cluster-wide."""

from __future__ import annotations

import json
from pathlib import Path

import click

from gpushared import __version__


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kubectl-inspect-gpushare")
@click.option("-d", "--details", is_flag=True, help="Show every pod per GPU.")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--kubeconfig", type=click.Path(path_type=Path), help="Default: $KUBECONFIG, then ~/.kube/config.")
@click.option("--context", help="The kubeconfig context to use.")
@click.option("--resource-domain", default="aliyun.com", show_default=True, help="Domain of gpu-mem / gpu-count.")
@click.argument("node", required=False)
def main(
    *, details: bool, output: str, kubeconfig: Path | None, context: str | None, resource_domain: str, node: str | None
) -> None:
    """Show GPU memory allocated per node and GPU [on NODE]."""
    from gpushared.contract import ResourceNames
    from gpushared.inspect.view import collect, render_details, render_summary
    from gpushared.kube.api import Api, KubeError, connect, default_kubeconfig

    try:
        api = Api(connect(kubeconfig or default_kubeconfig(), context=context))
        reports, warnings = collect(api, resources=ResourceNames(domain=resource_domain), node=node)
    except KubeError as exc:
        raise click.ClickException(str(exc)) from None
    if node is not None and not reports:
        raise click.ClickException(f"node {node} is not a gpushared node (or does not exist)")
    if output == "json":
        click.echo(json.dumps({"nodes": reports, "warnings": warnings}, indent=2))
        return
    click.echo(render_details(reports) if details else render_summary(reports))
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)


if __name__ == "__main__":
    main()
