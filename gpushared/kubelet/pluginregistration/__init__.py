"""The kubelet's plugin registration API (the plugins_registry directory): how a DRA plugin makes itself known."""
