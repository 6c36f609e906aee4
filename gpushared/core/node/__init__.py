"""What a node's containers get and are held to (Allocate, MPS, memory, compute, health). Read by the daemon."""
