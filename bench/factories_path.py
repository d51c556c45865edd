"""A realistic engine state (64 reports of history) for the transport benchmark."""

from __future__ import annotations

import sys
from pathlib import Path

from kvguard.transport.state import EngineState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sidecar"))


def state_for_bench() -> EngineState:
    from factories import report, state

    return state([report(i, holding=i % 3) for i in range(1, 65)])
