"""Field and label selectors as the Kubernetes API server parses and applies them."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Predicate = Callable[[dict[str, Any]], bool]

#: Fields each resource can be selected on (the API server refuses others with 400).
SELECTABLE_FIELDS = {
    "pods": {
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    },
    "nodes": {"metadata.name", "spec.unschedulable"},
    "resourceslices": {"metadata.name", "spec.nodeName", "spec.driver"},
    "events": {
        "metadata.name",
        "metadata.namespace",
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "source",
        "type",
    },
}


class SelectorError(ValueError):
    pass


def _field_value(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    if isinstance(node, dict):  # event "source" selects on source.component
        return str(node.get("component", ""))
    return str(node)


def field_selector(text: str | None, *, plural: str) -> Predicate:
    if not text:
        return lambda obj: True
    allowed = SELECTABLE_FIELDS.get(plural, {"metadata.name", "metadata.namespace"})
    terms: list[tuple[str, bool, str]] = []
    for term in text.split(","):
        match = re.fullmatch(r"\s*([A-Za-z0-9.]+)\s*(==|!=|=)\s*(.*?)\s*", term)
        if match is None:
            raise SelectorError(f"invalid field selector term {term!r}")
        field, operator, value = match.groups()
        if field not in allowed:
            raise SelectorError(f'field label not supported: "{field}"')
        terms.append((field, operator != "!=", value))
    return lambda obj: all((_field_value(obj, f) == v) is eq for f, eq, v in terms)


_LABEL_SET = re.compile(r"\s*([A-Za-z0-9./_-]+)\s+(in|notin)\s+\(([^)]*)\)\s*")
_LABEL_CMP = re.compile(r"\s*([A-Za-z0-9./_-]+)\s*(==|!=|=)\s*([A-Za-z0-9._-]*)\s*")
_LABEL_EXISTS = re.compile(r"\s*(!?)([A-Za-z0-9./_-]+)\s*")


def _split_terms(text: str) -> list[str]:
    """Split on commas outside parentheses (``a in (x,y),b``)."""
    terms, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return terms


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def label_selector(text: str | None) -> Predicate:
    if not text:
        return lambda obj: True
    checks: list[Predicate] = []
    for term in _split_terms(text):
        if match := _LABEL_SET.fullmatch(term):
            key, operator, values = (
                match.group(1),
                match.group(2),
                {v.strip() for v in match.group(3).split(",")},
            )
            if operator == "in":
                checks.append(lambda obj, k=key, vs=values: labels(obj).get(k) in vs)
            else:
                checks.append(lambda obj, k=key, vs=values: labels(obj).get(k) not in vs)
        elif match := _LABEL_CMP.fullmatch(term):
            key, operator, value = match.groups()
            if operator == "!=":
                checks.append(lambda obj, k=key, v=value: labels(obj).get(k) != v)
            else:
                checks.append(lambda obj, k=key, v=value: labels(obj).get(k) == v)
        elif match := _LABEL_EXISTS.fullmatch(term):
            negate, key = match.groups()
            checks.append(lambda obj, k=key, n=bool(negate): (k in labels(obj)) is not n)
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return lambda obj: all(check(obj) for check in checks)
