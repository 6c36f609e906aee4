"""What only a real GPU can tell (scripts/gpu-check, its entry point and its flags): one module per check,
the CUDA clients they run, and the report every run keeps."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The entry point, which --unit runs again inside the unit's sandbox (``--serve-mps``).
SCRIPT = REPO / "scripts" / "gpu-check"
