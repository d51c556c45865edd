"""What a chaos scenario expects of kvguard, and the signal that the engine did not take its path.

Shared by :mod:`kvguard.chaos.scenarios` (the matrix) and
:mod:`kvguard.chaos.offload_scenarios` (the offloading connector's drivers), which both
import it, so that neither imports the other at module level.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.core.offload import JobKind, OffloadVerdict
from kvguard.core.types import LeakCause, LeakPath


class NotExercised(AssertionError):
    """The engine did not take the path the scenario is about."""


@dataclass(frozen=True, slots=True)
class ExpectedLeak:
    cause: LeakCause
    path: LeakPath | None
    """None when the path is not knowable (a reference taken behind every hook)."""
    client_ids: frozenset[str] = frozenset()
    """Requests the report must name (empty: no request is knowable)."""
    named_by_fault: bool = False
    """The report must also name every request the fault fired on (chosen by vLLM's
    scheduling at run time, e.g. whichever request was preempted first)."""


@dataclass(frozen=True, slots=True)
class ExpectedOffload:
    """What kvguard's offload audit must say after the drive (its state's ``offload``)."""

    verdict: OffloadVerdict
    stuck_kind: JobKind | None = None
    owner_ids: frozenset[str] = frozenset()
    """Requests whose stuck jobs must be named."""
    waiting_ids: frozenset[str] = frozenset()
    """Requests that must be named as waiting behind them."""
