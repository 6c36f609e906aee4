"""The node daemon: GPU inventory, health, and the gpu-mem device plugin with its Allocate handshake."""
