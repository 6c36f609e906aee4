"""The three patch formats the Kubernetes API server accepts, as far as built-in objects use them.

- JSON patch (RFC 6902): add, remove, replace, move, copy, test.
- JSON merge patch (RFC 7386): objects merge, null deletes, everything else replaces.
- Strategic merge patch: like merge patch, except that lists with a merge key (containers by name,
  conditions by type, ...) merge item by item, and the ``$patch`` / ``$deleteFromPrimitiveList`` directives.
"""

from __future__ import annotations

import copy
from typing import Any

#: Lists of built-in core/v1 objects whose patch strategy is "merge", and the key they merge on.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "conditions": "type",
    "addresses": "type",
    "taints": "key",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
}
#: Lists of scalars whose strategy is "merge": union, order kept.
MERGED_SCALAR_LISTS = {"finalizers"}


class PatchError(ValueError):
    """The patch cannot be applied; ``status`` is the HTTP code the API server answers with."""

    def __init__(self, message: str, *, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


# --- RFC 7386 -------------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --- strategic merge --------------------------------------------------------------------------------------


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key == "$retainKeys":
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [item for item in result.get(field) or [] if item not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_keyed_list(result[key], value, MERGE_KEYS[key])
        elif isinstance(value, list) and key in MERGED_SCALAR_LISTS and isinstance(result.get(key), list):
            result[key] = result[key] + [item for item in value if item not in result[key]]
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_keyed_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    result = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"map in a list merged on {key!r} does not contain the merge key {key!r}", status=400)
        position = next(
            (i for i, old in enumerate(result) if isinstance(old, dict) and old.get(key) == item[key]), None
        )
        if item.get("$patch") == "delete":
            if position is not None:
                del result[position]
        elif position is None:
            result.append({k: v for k, v in item.items() if k != "$patch"})
        else:
            result[position] = strategic_merge_patch(result[position], item)
    return result


# --- RFC 6902 ---------------------------------------------------------------------------------------------


def json_patch(target: Any, operations: Any) -> Any:
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations", status=400)
    document = copy.deepcopy(target)
    for number, operation in enumerate(operations):
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise PatchError(f"operation {number} needs 'op' and 'path'", status=400)
        op, path = operation["op"], operation["path"]
        if op == "add":
            document = _add(document, path, copy.deepcopy(_value(operation)))
        elif op == "remove":
            document, _ = _remove(document, path)
        elif op == "replace":
            _resolve(document, path)  # must exist
            document, _ = _remove(document, path)
            document = _add(document, path, copy.deepcopy(_value(operation)))
        elif op in ("move", "copy"):
            source = operation.get("from")
            if not isinstance(source, str):
                raise PatchError(f"operation {number} ({op}) needs 'from'", status=400)
            if op == "move":
                document, value = _remove(document, source)
            else:
                value = copy.deepcopy(_resolve(document, source))
            document = _add(document, path, value)
        elif op == "test":
            if _resolve(document, path) != _value(operation):
                raise PatchError(f"testing value {path} failed")
        else:
            raise PatchError(f"unknown JSON patch operation {op!r}", status=400)
    return document


def _value(operation: dict[str, Any]) -> Any:
    if "value" not in operation:
        raise PatchError(f"operation {operation['op']} at {operation['path']} needs 'value'", status=400)
    return operation["value"]


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with '/'", status=400)
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _resolve(document: Any, path: str) -> Any:
    node = document
    for token in _tokens(path):
        node = _child(node, token, path)
    return node


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict) and token in node:
        return node[token]
    if isinstance(node, list) and token.isdigit() and int(token) < len(node):
        return node[int(token)]
    raise PatchError(f"path {path!r} does not exist")


def _add(document: Any, path: str, value: Any) -> Any:
    tokens = _tokens(path)
    if not tokens:
        return value
    parent = document
    for token in tokens[:-1]:
        parent = _child(parent, token, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise PatchError(f"index {last!r} out of range in {path!r}")
    else:
        raise PatchError(f"path {path!r} does not exist")
    return document


def _remove(document: Any, path: str) -> tuple[Any, Any]:
    tokens = _tokens(path)
    if not tokens:
        raise PatchError("cannot remove the whole document", status=400)
    parent = document
    for token in tokens[:-1]:
        parent = _child(parent, token, path)
    value = _child(parent, tokens[-1], path)
    if isinstance(parent, dict):
        del parent[tokens[-1]]
    else:
        del parent[int(tokens[-1])]
    return document, value
