"""The tracing tests: the core tests' reference engine (tests/core/_pool.py) is shared (no
package __init__ in tests/), and this directory holds the Phoenix fixture (_phoenix.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
