"""Per node, the most units free on one GPU that a plain and an MPS pod may take: what filter reads.

A filter looks up every candidate kube-scheduler sends, 500 of 5,000 nodes by default, so this table is
laid out for lookups rather than for clarity. At 5,000 nodes among 150k pods' objects, a dict lookup
costs mostly cache misses, and the largest is the key string the dict compares the request's name with:
left where the informer parsed the node, it shares no cache line or page with any other key. Hence:

- one dict per kind, of ints: no tuple to follow, and ints up to 256 (any room counted in GiB) are
  objects Python shares; beside them, each node's memory unit as a string (for the reason a node is too
  full), so a failed node needs no look at its state or its inventory, and no Enum's hash;
- keys copied in one go (:meth:`Rooms.compact`), so they lie side by side in memory: 500 lookups in a
  5,000-node table with cold caches take half the time (docs/benchmarks.md);
- a node whose ledger changed is marked stale in place rather than popped: the dict keeps the key it had,
  and the table stays compact while pods come and go.
"""

from __future__ import annotations

#: A node's room that must be worked out again; also what a lookup of a name not in the table gives.
STALE = -2

#: New nodes added since the last compaction, as a fraction of the table, before it is compacted again.
REGROWTH = 8


class Rooms:
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
