"""Resources and units: the extended resources a node advertises and what one unit of GPU memory is."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Final

from gpushared.contract.reading import ContractError


class MemoryUnit(enum.Enum):
    """What one unit of the gpu-mem resource means on a node.

    Aliyun leaves the unit implicit and its inspect tool guesses it from the size of a GPU; we declare it in
    the node inventory and in every allocation so that nothing has to guess.
    """

    MIB = "MiB"
    GIB = "GiB"

    @property
    def mib(self) -> int:
        """MiB in one unit."""
        return 1 if self is MemoryUnit.MIB else 1024

    @classmethod
    def parse(cls, text: object, *, key: str = "unit") -> MemoryUnit:
        for unit in cls:
            if text == unit.value:
                return unit
        raise ContractError(key=key, value=text, reason="'unit' must be 'MiB' or 'GiB'")

    def from_mib(self, mib: int) -> int:
        """Whole units in ``mib`` MiB, rounded down: a GPU never advertises memory it does not have."""
        return mib // self.mib

    def to_mib(self, amount: int) -> int:
        return amount * self.mib

    def to_bytes(self, amount: int) -> int:
        """For metrics, which are in base units whatever the node's unit is."""
        return self.to_mib(amount) * 2**20

    def convert(self, amount: int, *, to: MemoryUnit) -> int:
        """``amount`` of this unit expressed in ``to``, rounded up: a holding is never under-counted."""
        return math.ceil(amount * self.mib / to.mib)


@dataclass(frozen=True)
class ResourceNames:
    """The extended resource names; the domain is configurable for clusters that run both stacks."""

    domain: str = "aliyun.com"

    @property
    def gpu_mem(self) -> str:
        return f"{self.domain}/gpu-mem"

    @property
    def gpu_count(self) -> str:
        return f"{self.domain}/gpu-count"


DEFAULT_RESOURCES: Final = ResourceNames()

#: Node label that Aliyun's DaemonSet selects on; kept so that existing node pools keep working.
NODE_LABEL_GPUSHARE: Final = "gpushare"
