"""Where a pod or a DRA claim goes: fit, policies, prices, the request mix, binds, what a claim asks. Read by
the extender, replay, inspect and the claim allocator."""
