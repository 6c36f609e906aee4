"""The GPUs of this machine, read through NVML (pynvml) behind a small interface."""
