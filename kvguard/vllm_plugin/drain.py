"""Decide from the scheduler's real state whether this is a drained moment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvguard.core.classify import HoldRule, hold_is_legitimate
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.types import RequestId


@dataclass(frozen=True, slots=True)
class DrainState:
    """``drained`` is true when no work is in flight and nothing legitimate holds blocks.

    ``suspects`` are finished requests still in the scheduler (delayed free) whose
    hold has outlived its bound: they are exactly what a drained checkpoint is
    for, so they do not prevent one.
    """

    drained: bool
    reason: str = ""
    live_work: bool = False
    """Waiting/running work exists: no checkpoint until a free happens again."""
    suspects: list[RequestId] = field(default_factory=list)


def _qlen(obj: Any) -> int:
    try:
        return len(obj)
    except TypeError:
        return 0


def drain_state(
    scheduler: Any, ledger: OwnershipLedger, now: float, delayed_free_bound_seconds: float
) -> DrainState:
    running = _qlen(getattr(scheduler, "running", ()))
    waiting = _qlen(getattr(scheduler, "waiting", ()))
    if running or waiting:
        return DrainState(False, f"{running} running, {waiting} waiting", live_work=True)
    deferred = _qlen(getattr(scheduler, "deferred_frees", ()))
    if deferred:
        return DrainState(False, f"{deferred} deferred frees pending (in-flight step)")
    requests: dict[str, Any] = getattr(scheduler, "requests", {}) or {}
    suspects: list[RequestId] = []
    rule = HoldRule(now=now, bound_seconds=delayed_free_bound_seconds)
    for rid, req in requests.items():
        is_finished = getattr(req, "is_finished", None)
        if is_finished is None or not is_finished():
            return DrainState(False, f"request {rid} is not finished", live_work=True)
        rec = ledger.record(RequestId(rid))
        if rec is not None and hold_is_legitimate(rec, rule):
            started = rec.delayed_free_started_at or now
            return DrainState(
                False,
                f"request {rid} waits for its KV transfer ({now - started:.1f} s of the "
                f"{delayed_free_bound_seconds:.0f} s bound)",
            )
        suspects.append(RequestId(rid))
    return DrainState(True, suspects=suspects)
