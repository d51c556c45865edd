"""The KV-event tests: the page tests' browser helpers are shared (no package __init__ in
tests/), and this directory holds the test scheduler the servers load (kv_truth_scheduler)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pages"))
