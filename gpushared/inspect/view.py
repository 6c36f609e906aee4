"""Collect nodes and pods into per-node reports, and print them as Aliyun's inspect tool does.

The table keeps Aliyun's columns (NAME, IPADDRESS, GPU<i>(Allocated/Total), PENDING(Allocated) when any
node has pods without a GPU, GPU Memory(<unit>)) and its cluster line, so scripts that read it keep
working; the unit comes from the node's inventory instead of being guessed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from gpushared.contract import ContractError, GpuInventory, ResourceNames
from gpushared.core.dra.allocated import claim_holdings
from gpushared.core.placement.report import LINK_LEGEND, link_matrix_lines, node_report, set_links
from gpushared.core.shared.bodies import NodeBody, PodBody, node_of
from gpushared.core.shared.ledger import Ledger, holding_from_pod, inventory_from_node
from gpushared.kube.api import Api, KubeError
from gpushared.kube.resources import ResourceApi


def collect(api: Api, *, resources: ResourceNames, node: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(reports, warnings): one report per gpushared node (or the named one)."""
    nodes = [n for n in api.list_nodes() if node is None or n["metadata"]["name"] == node]
    pods = api.list_pods(node=node)
    by_node: dict[str, list[PodBody]] = {}
    for pod in pods:
        if node_of(pod):
            by_node.setdefault(node_of(pod), []).append(pod)
    reports: list[dict[str, Any]] = []
    warnings: list[str] = []
    claims = _claims(api, warnings)
    for body, inventory in gpushared_nodes(sorted(nodes, key=lambda n: n["metadata"]["name"]), resources, warnings):
        name = body["metadata"]["name"]
        ledger = Ledger.build(inventory)
        held, problems = claim_holdings(claims, node=name, inventory=inventory)
        warnings += problems
        for claimed in held:
            ledger.add(claimed)
        for pod in by_node.get(name, []):
            holding = holding_from_pod(pod, unit=inventory.unit, resources=resources)
            if holding is not None:
                ledger.add(holding)
                if holding.problem:
                    warnings.append(f"pod {holding.namespace}/{holding.name}: {holding.problem}")
        address = next(
            (a["address"] for a in (body.get("status") or {}).get("addresses") or [] if a.get("type") == "InternalIP"),
            "",
        )
        reports.append(node_report(name=name, address=address, inventory=inventory, holdings=ledger.holdings()))
    return reports, warnings


def _claims(api: Api, warnings: list[str]) -> list[dict[str, Any]]:
    """The cluster's ResourceClaims, where it serves DRA (Kubernetes >= 1.34): on DRA nodes they hold the
    GPUs (docs/dra.md). None elsewhere; a caller who may not list them is told, and sees the pods alone."""
    resources = ResourceApi(api.rest)
    try:
        return resources.list_claims() if resources.served() else []
    except KubeError as exc:
        warnings.append(f"ResourceClaims not listed ({exc}): GPUs held by DRA claims are not shown")
        return []


def gpushared_nodes(
    bodies: Iterable[NodeBody], resources: ResourceNames, warnings: list[str]
) -> Iterator[tuple[NodeBody, GpuInventory]]:
    """The gpushared nodes among ``bodies``, each with its inventory; a node whose inventory cannot be read
    is passed over with a warning."""
    for body in bodies:
        try:
            inventory = inventory_from_node(body, resources=resources)
        except ContractError as exc:
            warnings.append(f"node {body['metadata']['name']}: {exc}")
            continue
        if inventory is not None:
            yield body, inventory


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell plus two spaces, as Go's tabwriter lays Aliyun's out."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["".join(cell.ljust(w + 2) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _percent(used: int, total: int) -> str:
    return f"{used * 100 // total if total else 0}%"


def _cluster_unit(reports: Sequence[dict[str, Any]]) -> str:
    units = {r["unit"] for r in reports}
    return units.pop() if len(units) == 1 else "/".join(sorted(units))


def render_summary(reports: Sequence[dict[str, Any]]) -> str:
    if not reports:
        return "No gpushared nodes found."
    gpus = max(len(r["devs"]) for r in reports)
    pending = any(r["pending"] for r in reports)
    unit = _cluster_unit(reports)
    header = ["NAME", "IPADDRESS", *[f"GPU{i}(Allocated/Total)" for i in range(gpus)]]
    header += ["PENDING(Allocated)"] if pending else []
    header += [f"GPU Memory({unit})"]
    rows = [header]
    for r in reports:
        cells = [r["name"], r["address"]]
        cells += [f"{d['usedGPU']}/{d['totalGPU']}" for d in r["devs"]]
        cells += ["0/0"] * (gpus - len(r["devs"]))
        if pending:
            cells += [str(sum(p["usedGPU"] for p in r["pending"]))]
        cells += [f"{r['usedGPU']}/{r['totalGPU']}"]
        rows.append(cells)
    used = sum(r["usedGPU"] for r in reports)
    total = sum(r["totalGPU"] for r in reports)
    lines = _table(rows)
    lines += [
        "-" * max(len(line) for line in lines),
        "Allocated/Total GPU Memory In Cluster:",
        f"{used}/{total} ({_percent(used, total)})",
    ]
    return "\n".join(lines)


def _in_use(dev: dict[str, Any]) -> str:
    """What a GPU's processes use, beside what is allocated on it: the node's memory watcher's reading."""
    return "-" if dev.get("inUseMiB") is None else str(dev["inUseMiB"])


def _links(report: dict[str, Any], pods: dict[tuple[str, str], dict[int, int]]) -> list[str]:
    """The node's link matrix, and how the GPUs of each pod on several are linked; nothing when the node's
    links are not known (an older driver, or a daemon from before links were published)."""
    matrix = report.get("links")
    if not matrix:
        return []
    gpus = [d["id"] for d in report["devs"]]
    lines = ["", "GPU links:", *link_matrix_lines(gpus, matrix, [d.get("numa") for d in report["devs"]]), LINK_LEGEND]
    several = {key: sorted(held) for key, held in pods.items() if len(held) > 1}
    if several:
        lines.append("")
        for (name, namespace), on in sorted(several.items(), key=lambda item: (item[0][1], item[0][0])):
            lines.append(f"{namespace}/{name} on GPUs {','.join(map(str, on))}: {set_links(gpus, on, matrix)}")
    return [*lines, ""]


def render_details(reports: Sequence[dict[str, Any]]) -> str:
    if not reports:
        return "No gpushared nodes found."
    out: list[str] = []
    for r in reports:
        out += [f"NAME:       {r['name']}", f"IPADDRESS:  {r['address']}", ""]
        pods: dict[tuple[str, str], dict[int, int]] = {}
        compute: dict[tuple[str, str], int] = {}
        for d in r["devs"]:
            for p in d["pods"]:
                pods.setdefault((p["name"], p["namespace"]), {})[d["id"]] = p["usedGPU"]
                compute[(p["name"], p["namespace"])] = p.get("computeRequest", 0)
        pending = {(p["name"], p["namespace"]): p["usedGPU"] for p in r["pending"]}
        compute.update({(p["name"], p["namespace"]): p.get("computeRequest", 0) for p in r["pending"]})
        shares = any(compute.values())  # a column for compute requests only where some pod makes one
        header = ["NAME", "NAMESPACE", *[f"GPU{d['id']}(Allocated)" for d in r["devs"]]]
        header += ["Pending(Allocated)"] if pending else []
        header += ["Compute(Requested %)"] if shares else []
        rows = [header]
        for key in sorted(pods.keys() | pending.keys(), key=lambda k: (k[1], k[0])):
            row = [key[0], key[1], *[str(pods.get(key, {}).get(d["id"], 0)) for d in r["devs"]]]
            row += [str(pending.get(key, 0))] if pending else []
            row += [str(compute.get(key, 0) or "-")] if shares else []
            rows.append(row)
        tail = [""] * (bool(pending) + shares)
        if any(d.get("inUseMiB") is not None for d in r["devs"]):
            rows.append(["(in use, MiB)", "", *[_in_use(d) for d in r["devs"]], *tail])
        if shares:
            rows.append(["(compute requested)", "", *[f"{d.get('computeRequested', 0)}%" for d in r["devs"]], *tail])
        out += _table(rows)
        out += _links(r, pods)
        out += [
            f"Allocated :  {r['usedGPU']} ({_percent(r['usedGPU'], r['totalGPU'])})",
            f"Total :      {r['totalGPU']} ({r['unit']})",
            "-" * 60,
            "",
        ]
    used = sum(r["usedGPU"] for r in reports)
    total = sum(r["totalGPU"] for r in reports)
    out += ["", "Allocated/Total GPU Memory In Cluster:  " + f"{used}/{total} ({_percent(used, total)})"]
    return "\n".join(out)
