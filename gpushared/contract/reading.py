"""Reading what tenants may write: errors that name the key, the value (shown safely) and the reason, and
the bounds every reader holds an annotation's text to before it parses it (docs/design.md §10).

Part of the contract, with a public API of its own for the contract's other parts: ``parse_int``,
``parse_bool``, ``format_bool``, ``load_json`` (bounded size and depth, integers and floats held to their
bounds), ``versioned_object`` (a record's JSON object, refused when newer), and ``require_int``,
``require_str``, ``require_bool`` (a field of it, typed). ``gpushared.contract`` re-exports the errors, the
bounds and the scalar readers; no part reaches for another's underscore names.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

# ---------------------------------------------------------------------------------------------------------
# Errors


class ContractError(ValueError):
    """A value in an annotation, resource or env key that does not follow the contract."""

    def __init__(self, *, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{key}: {reason} (got {_shown(value)})")


def _shown(value: object) -> str:
    """``value`` for an error message, at most 120 characters. A tenant's text can be a 256 KiB string,
    an integer whose repr CPython refuses (over 4,300 digits) or JSON nested past the recursion limit:
    none of them may turn the report of a bad value into a crash."""
    if isinstance(value, str):
        shown = repr(value[:120])
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**100:
        shown = f"an integer of {abs(value).bit_length()} bits"
    else:
        try:
            shown = repr(value)
        except (ValueError, RecursionError):
            shown = f"a {type(value).__name__}"
    return shown if len(shown) <= 120 else shown[:117] + "..."


class NewerVersion(ContractError):
    """An annotation a newer gpushared wrote: well formed for it, unreadable here (a rollback, or a reader
    upgraded after its writer). Readers that have another source for the same fact use that instead."""


#: The version of the JSON bodies this build writes and the newest it reads.
CONTRACT_VERSION: Final = 1

# ---------------------------------------------------------------------------------------------------------
# Bounds on what a reader parses: annotations are written by tenants too (docs/design.md §10)

#: The largest integer any annotation may hold: Go's int64, which Aliyun's readers parse into.
MAX_INT: Final = 2**63 - 1
#: The longest decimal text :func:`parse_int` reads: a sign and int64's 19 digits.
MAX_INT_TEXT: Final = 20
#: The longest JSON annotation a reader parses: the API server's limit on all of an object's annotations
#: together (256 KiB), so no value it accepted is refused for its length alone.
MAX_JSON_BYTES: Final = 256 * 1024
#: The deepest nesting a JSON annotation may have; ours nest four deep.
MAX_JSON_DEPTH: Final = 16

# ---------------------------------------------------------------------------------------------------------
# Scalar values


def parse_int(key: str, text: object, *, minimum: int = 0, maximum: int | None = None) -> int:
    """A decimal integer as Go's strconv.Atoi writes it: optional '-', ASCII digits, nothing else, within
    int64. The length is checked before the digits are read: CPython refuses to convert more than 4,300
    digits with a ValueError, which a caller expecting ContractError would let escape."""
    if not isinstance(text, str) or len(text) > MAX_INT_TEXT:
        raise ContractError(key=key, value=text, reason="expected a decimal integer of at most 19 digits")
    digits = text[1:] if text.startswith("-") else text
    if not digits.isascii() or not digits.isdigit():
        raise ContractError(key=key, value=text, reason="expected a decimal integer")
    value = int(text)
    if not -MAX_INT - 1 <= value <= MAX_INT:
        raise ContractError(key=key, value=text, reason="out of the range of a 64-bit integer")
    if value < minimum:
        raise ContractError(key=key, value=text, reason=f"must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ContractError(key=key, value=text, reason=f"must be <= {maximum}")
    return value


def parse_bool(key: str, text: object) -> bool:
    """Aliyun writes and compares the exact strings "true" and "false"; so do we."""
    if text == "true":
        return True
    if text == "false":
        return False
    raise ContractError(key=key, value=text, reason="expected 'true' or 'false'")


def format_bool(value: bool) -> str:
    return "true" if value else "false"


# ---------------------------------------------------------------------------------------------------------
# Helpers


class _JsonNumber(ValueError):
    """A number in a JSON annotation outside int64, or not an integer where only integers are written."""


def _json_int(text: str) -> int:
    if len(text) > MAX_INT_TEXT:
        raise _JsonNumber(f"integer of {len(text)} characters")
    value = int(text)
    if not -MAX_INT - 1 <= value <= MAX_INT:
        raise _JsonNumber("integer out of the range of a 64-bit integer")
    return value


def _json_float(text: str) -> float:
    # Nothing in the contract is a fraction; a float is kept (so a reader can say which field holds it) but
    # never converted from more than a number's worth of characters.
    if len(text) > 32:
        raise _JsonNumber(f"number of {len(text)} characters")
    return float(text)


def load_json(key: str, text: str) -> Any:
    """``text`` as JSON, within the bounds above; every way it can fail is a :class:`ContractError`."""
    if not isinstance(text, str):
        raise ContractError(key=key, value=text, reason="expected a JSON text")
    if len(text) > MAX_JSON_BYTES:
        raise ContractError(key=key, value=text, reason=f"longer than {MAX_JSON_BYTES} characters")
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _nesting(text) > MAX_JSON_DEPTH:
        raise ContractError(key=key, value=text, reason=f"nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, parse_int=_json_int, parse_float=_json_float)
    except _JsonNumber as exc:
        raise ContractError(key=key, value=text, reason=f"not a valid number ({exc})") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ContractError(key=key, value=text, reason=f"not valid JSON ({exc})") from None


def _nesting(text: str) -> int:
    """How deep the JSON ``text`` nests (brackets inside strings skipped), before the parser recurses once
    per level; for text that is not JSON, a number the parser's own error then makes moot."""
    deepest = depth = 0
    for match in _BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


#: A JSON string (skipped whole) or a bracket.
_BRACKETS: Final = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def versioned_object(key: str, text: str) -> dict[str, Any]:
    body = load_json(key, text)
    if not isinstance(body, dict):
        raise ContractError(key=key, value=text, reason="expected a JSON object")
    version = body.get("version")
    if type(version) is not int or version < 1:
        raise ContractError(key=key, value=text, reason="'version' must be a positive integer")
    if version > CONTRACT_VERSION:
        raise NewerVersion(
            key=key,
            value=text,
            reason=f"version {version} is newer than this gpushared reads ({CONTRACT_VERSION}); upgrade it",
        )
    return body


def require_int(key: str, where: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise ContractError(key=key, value=value, reason=f"{where} must be a non-negative integer")
    return value


def require_str(key: str, where: str, value: object) -> str:
    if not isinstance(value, str):
        raise ContractError(key=key, value=value, reason=f"{where} must be a string")
    return value


def require_bool(key: str, where: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ContractError(key=key, value=value, reason=f"{where} must be true or false")
    return value
