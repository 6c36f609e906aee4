"""The claim allocator: gpushared's policies for DRA claims, in front of kube-scheduler's first fit. It runs
in the extender's leader, on the extender's event loop, and owns nothing the extender's cache owns.

- ``allocator``: the loop. Each step reads the gated pods, decides (wait, allocate, preempt, hand over), assumes
  what it chose and starts the writes (``ClaimAllocator``).
- ``cache``: every ResourceClaim, the devices each node publishes for this driver, and each DRA node's
  ledger of the claims allocated there, with the allocations written and not yet shown (assumed).
- ``placing``: the nodes a pod may go to and the placement the policy works out on each, kept until
  something it read changes (``ClaimPlacer``).
- ``preempting``: for a gated pod that fits nowhere, the lower-priority pods whose claims hold the room
  evicted, and the room they free held for it (``ClaimPreempter``).
- ``fence``: the room kept free for pods kube-scheduler may be allocating claims for meanwhile.
- ``writes``: the API calls: a claim's allocation (its finalizer first), the gate's removal, a release,
  and the permissions the API server refused (``ClaimWrites``, ``Refusals``).

What each step decides is pure and tested as tables in ``gpushared.core.placement.claims``; the webhook
route that adds the gate is ``extender.routes``; docs/dra.md ("The claim allocator") has the whole path.
"""
