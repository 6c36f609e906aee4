"""Kubernetes resource quantities, as far as extended resources and CPU requests use them.

Extended resources such as ``aliyun.com/gpu-mem`` must be whole numbers, but the API server accepts any
quantity spelling for them ("4", "4k", "1Ki", "2e3"). We read them all exactly and refuse fractions with a
message instead of rounding: a rounded request would be a silent wrong amount.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Final

from gpushared.contract import ContractError

_SUFFIXES: Final = {
    "": Decimal(1),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
    "m": Decimal(1) / 1000,
    "u": Decimal(1) / 10**6,
    "n": Decimal(1) / 10**9,
}
#: Bounds checked on the text, before any arithmetic: Kubernetes keeps quantities in 64 bits, and
#: ``1e999999`` would otherwise become a million-digit integer, 41 s of the extender's event loop
#: (docs/benchmarks.md, "What a request may hold the event loop for").
#: The longest quantity text read (a mantissa, an exponent or suffix, a sign): Kubernetes' own are far shorter.
MAX_LENGTH: Final = 80
MAX_EXPONENT: Final = 30
#: Kubernetes' largest quantity: int64.
MAX_VALUE: Final = Decimal(2) ** 63 - 1
_QUANTITY: Final = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([eE][+-]?[0-9]+)|([a-zA-Z]*))$")


def parse_whole_quantity(key: str, value: object) -> int:
    """The integer value of a quantity; ``key`` names the field in errors."""
    number = _decimal(key, value)
    if number != number.to_integral_value():
        raise ContractError(key=key, value=value, reason="extended resources must be whole numbers")
    return int(number)


def parse_milli_quantity(key: str, value: object) -> int:
    """A quantity in thousandths, rounded up as Kubernetes' MilliValue rounds ("1.5" CPUs: 1500, "1u": 1)."""
    return int((_decimal(key, value) * 1000).to_integral_value(rounding=ROUND_CEILING))


def _decimal(key: str, value: object) -> Decimal:
    if isinstance(value, bool):
        raise ContractError(key=key, value=value, reason="expected a quantity")
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, str):
        if len(value) > MAX_LENGTH:
            raise ContractError(key=key, value=value[:40] + "...", reason="too long for a quantity")
        match = _QUANTITY.match(value.strip())
        if match is None or (match.group(3) or "") not in _SUFFIXES:
            raise ContractError(key=key, value=value, reason="not a Kubernetes quantity")
        exponent = match.group(2)
        if exponent is not None and abs(int(exponent[1:])) > MAX_EXPONENT:
            raise ContractError(key=key, value=value, reason=f"exponent beyond ±{MAX_EXPONENT}")
        try:
            number = Decimal(match.group(1) + (match.group(2) or "")) * _SUFFIXES[match.group(3) or ""]
        except InvalidOperation:
            raise ContractError(key=key, value=value, reason="not a Kubernetes quantity") from None
    else:
        raise ContractError(key=key, value=value, reason="expected a quantity")
    if number < 0:
        raise ContractError(key=key, value=value, reason="must not be negative")
    if number > MAX_VALUE:
        raise ContractError(key=key, value=value, reason="larger than Kubernetes' largest quantity (2^63 - 1)")
    return number
