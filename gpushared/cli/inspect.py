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
@click.option(
    "--expected-mix",
    is_flag=True,
    help="Print the kinds of the pods on gpushared nodes, counted as the extender counts them, as the JSON "
    "its --expected-mix reads.",
)
@click.option(
    "--gpu-model-label",
    default="nvidia.com/gpu.product",
    show_default=True,
    help="With --expected-mix: the node label naming GPU models, as the extender's option of that name.",
)
@click.argument("node", required=False)
def main(
    *,
    details: bool,
    output: str,
    kubeconfig: Path | None,
    context: str | None,
    resource_domain: str,
    expected_mix: bool,
    gpu_model_label: str,
    node: str | None,
) -> None:
    """Show GPU memory allocated per node and GPU [on NODE]."""
    from gpushared.contract import ResourceNames
    from gpushared.inspect.mix import collect_mix
    from gpushared.inspect.view import collect, render_details, render_summary
    from gpushared.kube.api import Api, KubeError, connect, default_kubeconfig

    if expected_mix and node is not None:
        raise click.UsageError("--expected-mix counts the whole cluster: name no node")
    try:
        api = Api(connect(kubeconfig or default_kubeconfig(), context=context))
        if expected_mix:
            document, warnings = collect_mix(
                api, resources=ResourceNames(domain=resource_domain), model_label=gpu_model_label
            )
            click.echo(json.dumps(document, indent=1))
            for warning in warnings:
                click.echo(f"warning: {warning}", err=True)
            return
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
