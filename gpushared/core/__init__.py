"""The pure allocation core: requests, the per-node ledger, placement policies. No I/O, no client types."""
