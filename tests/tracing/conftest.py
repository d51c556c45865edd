"""The tracing tests: the core tests' reference engine (tests/core/_pool.py) and the P/D
tests' helpers (tests/pd/_pd.py) are shared (no package __init__ in tests/), and this
directory holds the Phoenix fixture (_phoenix.py)."""

from __future__ import annotations

import sys
from pathlib import Path

for shared in ("core", "pd"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / shared))
