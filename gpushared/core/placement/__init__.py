"""Where a pod goes: fit, policies, prices, the request mix, binds. Read by the extender, replay and inspect."""
