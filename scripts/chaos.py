"""The fault suite's entry point (``make chaos``): scripts/faultsuite/ holds the harness, one module per
scenario and the counting; ``faultsuite.runner`` says what the suite does and its flags.

    .venv/bin/python scripts/chaos.py [--pods 200] [--nodes 30] [--threads 8] [--only NAME ...] [--json FILE]
    .venv/bin/python scripts/chaos.py --table FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # gpushared and tests
sys.path.insert(0, str(Path(__file__).resolve().parent))  # faultsuite

from faultsuite.runner import main

if __name__ == "__main__":
    sys.exit(main())
