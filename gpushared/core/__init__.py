"""The pure core: every decision, no I/O, no client types. Four rooms, one per job and one they share:

- ``core.shared``: what all read (bodies, quantities, requests, the GPU ledger and its verdicts);
- ``core.placement``: where a pod goes (the extender, the trace replay, inspect);
- ``core.node``: what a node's containers get and are held to (the daemon's device plugin and watchers);
- ``core.dra``: what the DRA driver decides for claims and slices, built on ``core.node``.

``.importlinter`` holds them to it: the node and DRA sides never import placement, placement never imports
them, and shared imports none of the three.
"""
