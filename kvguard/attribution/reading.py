"""One guarded read: a probe call that fails becomes an ``unavailable`` entry.

Probes read many independent counters; one that raises (an old torch, a
backend without that statistic, NVML permission) must not lose the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def guarded(what: str, read: Callable[[], T], unavailable: list[str]) -> T | None:
    """``read()``, or None with ``"<what>: <error>"`` appended to ``unavailable``."""
    try:
        return read()
    except Exception as exc:  # a probe failure is data, not an engine error
        unavailable.append(f"{what}: {type(exc).__name__}: {exc}"[:200])
        return None
