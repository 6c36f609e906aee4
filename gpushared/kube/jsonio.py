"""JSON for the API client: orjson where it is installed (the daemon, the extender: 3-6x the standard
library's speed on list and watch bodies), the standard library where it is not (the single-file
``kubectl-inspect-gpushare``, which carries pure Python only so that it runs on any machine with Python).
The same three names either way: ``loads``, ``dumps`` (to bytes) and ``JSONDecodeError``."""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # the zipapp (scripts/build-inspect), run by tests/integration/test_inspect_zipapp.py
    orjson = None  # type: ignore[assignment]

#: what a body that does not parse raises (orjson's is a subclass of the standard library's)
JSONDecodeError = json.JSONDecodeError


def loads(data: bytes | str) -> Any:
    return orjson.loads(data) if orjson is not None else json.loads(data)


def dumps(value: Any) -> bytes:
    if orjson is not None:
        return orjson.dumps(value)
    return json.dumps(value, separators=(",", ":")).encode()
