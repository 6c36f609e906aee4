"""Per node, the most units free on one GPU that a plain and an MPS pod may take: what filter reads.

A filter looks up every candidate kube-scheduler sends, so this table is laid out for those lookups: one
dict of ints per kind of pod, each node's memory unit beside them as a string, keys copied side by side
(:meth:`Rooms.compact`), and a stale room marked in place rather than popped. Why, and what it measured:
docs/benchmarks.md, "What changed, second pass".
"""

from __future__ import annotations

#: A node's room that must be worked out again; also what a lookup of a name not in the table gives.
STALE = -2

#: New nodes added since the last compaction, as a fraction of the table, before it is compacted again.
REGROWTH = 8


class Rooms:
    """The most memory free on one GPU, per node and per kind of pod (plain, MPS): what a filter reads
    first. A room is in units of the node's memory unit, -1 when no GPU of the node is usable by that kind
    of pod, STALE when the node's ledger changed since it was worked out."""

    def __init__(self) -> None:
        self.plain: dict[str, int] = {}
        self.mps: dict[str, int] = {}
        #: name -> the value of the node's MemoryUnit ("" for a node with no ledger)
        self.units: dict[str, str] = {}
        self._added = 0

    def __len__(self) -> int:
        return len(self.plain)

    def __contains__(self, name: str) -> bool:
        return name in self.plain

    def of(self, *, mps: bool) -> dict[str, int]:
        """The table for one kind of pod: name -> room, STALE, or missing."""
        return self.mps if mps else self.plain

    def put(self, name: str, *, plain: int, mps: int, unit: str) -> None:
        """A node's rooms, written in place when the node is in the table already. A filter holds on to the
        dicts it started with: a compaction here leaves them complete, since the node goes in first."""
        if name not in self.plain:
            self._added += 1
        self.plain[name], self.mps[name], self.units[name] = plain, mps, unit
        if self._added * REGROWTH > len(self.plain) + 64:
            self.compact()

    def stale(self, name: str) -> None:
        if name in self.plain:
            self.plain[name] = self.mps[name] = STALE

    def compact(self) -> None:
        """Copy every key, one after another, into new dicts: see the module's docstring."""
        keys = [name.encode().decode() for name in self.plain]
        self.plain = dict(zip(keys, self.plain.values(), strict=True))
        self.mps = dict(zip(keys, self.mps.values(), strict=True))
        self.units = dict(zip(keys, self.units.values(), strict=True))
        self._added = 0
