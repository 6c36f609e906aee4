"""``kubectl inspect gpushare``: the cluster's GPUs and who holds them, read from the API server."""
