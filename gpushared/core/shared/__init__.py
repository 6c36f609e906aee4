"""What all three jobs read: bodies, quantities, requests, a node's GPU ledger and what fits it, links, certificates."""
