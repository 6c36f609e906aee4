"""Parts the benchmarks share: timing and CPU pinning, the extender benchmark's cluster, the kube-scheduler
benchmark's figures. Each benchmark stays one script in scripts/ that states its exact command."""
