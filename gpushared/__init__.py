"""gpushared: share GPUs between Kubernetes pods by GPU memory.

The package is layered (see ``.importlinter``): :mod:`gpushared.contract` and :mod:`gpushared.core` are pure
and shared by every component; adapters (NVML, kubelet gRPC, Kubernetes API, HTTP) wrap them; the CLI
entry points sit on top.
"""

__version__ = "0.1.0"
