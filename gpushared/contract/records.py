"""gpushared's own annotations: their names, and the pod's allocation, versioned in its JSON body (a reader
refuses a newer version with "upgrade it")."""

from __future__ import annotations

from typing import Final

ANNOTATION_DOMAIN: Final = "gpushared.io"
#: Node: the GPUs the daemon found, with their own sizes and health (Aliyun assumes equal sizes).
NODE_INVENTORY: Final = f"{ANNOTATION_DOMAIN}/gpu-inventory"
#: Pod: container -> GPU -> amount, so that Allocate (called once per container) can be exact.
POD_ALLOCATION: Final = f"{ANNOTATION_DOMAIN}/allocation"
#: Pod: "true" opts the pod into the GPU's MPS server.
POD_MPS: Final = f"{ANNOTATION_DOMAIN}/mps"
#: Pod: overrides the derived CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (1-100).
POD_MPS_THREAD_PERCENTAGE: Final = f"{ANNOTATION_DOMAIN}/mps-active-thread-percentage"
#: Pod: "off", "report" or "kill": what the daemon does when the pod's containers use more GPU memory than
#: they were allocated; only stricter than the node's setting takes effect (core.node.memory).
POD_MEMORY_ENFORCEMENT: Final = f"{ANNOTATION_DOMAIN}/memory-enforcement"
