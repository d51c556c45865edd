"""``DrainCheck``: what the engine keeps in the way of a drained moment, read from its activity.

The session's own part of "is this moment drained?" (its monitors may add theirs,
:meth:`~kvguard.core.monitor.Monitor.drain_blocker`). A finished request the engine still
keeps blocks a drain only while its hold is legitimate
(:func:`~kvguard.core.classify.hold_is_legitimate`); past that, it is exactly what a
drained checkpoint is for. Deferred frees left pending with no batch in flight block it
for the same bound from when they were first seen (a step that would release them may
still come; an idle engine has none in flight).
"""

from __future__ import annotations

from kvguard.core.classify import HoldRule, hold_legitimate_until
from kvguard.core.engine import EngineActivity
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.monitor import DrainBlocker
from kvguard.core.types import RequestId


class DrainCheck:
    """Judges an engine's activity; remembers when deferred frees were first seen."""

    def __init__(self) -> None:
        self.deferred_seen_at: float | None = None
        """When deferred frees were first seen pending with nothing in flight (Unix s)."""

    def blocker(self, act: EngineActivity, ledger: OwnershipLedger, now: float,
                bound: float) -> DrainBlocker | None:
        """Why ``act`` is not a drained moment at ``now`` (Unix s), or None when it is;
        ``bound``: the seconds a delayed or deferred free may last."""
        if act.running or act.waiting:
            return DrainBlocker(f"{act.running} running, {act.waiting} waiting", True)
        if act.batches_in_flight:
            # No live work, but a scheduled batch is still running (async scheduling): it
            # ends at the next step end, which checks again (drain_pending stays set).
            self.deferred_seen_at = None
            return DrainBlocker(f"{act.batches_in_flight} scheduled batch(es) still in "
                                "flight", False)
        if act.deferred_frees:
            seen = self.deferred_seen_at if self.deferred_seen_at is not None else now
            self.deferred_seen_at = seen
            until = seen + bound
            if now < until:
                return DrainBlocker(f"{act.deferred_frees} deferred frees pending "
                                    f"(in-flight step; {now - seen:.1f} s of the "
                                    f"{bound:.0f} s bound)", False, until)
        else:
            self.deferred_seen_at = None
        if act.unfinished is not None:
            return DrainBlocker(f"request {act.unfinished} is not finished", True)
        rule = HoldRule(now=now, bound_seconds=bound)
        for rid in act.finished_held:
            rec = ledger.record(RequestId(rid))
            ends = hold_legitimate_until(rec, rule) if rec is not None else None
            if rec is not None and ends is not None and now < ends:
                started = rec.delayed_free_started_at or now
                if rec.hold_deadline is not None:
                    return DrainBlocker(
                        f"request {rid} waits for its KV transfer ({now - started:.1f} s, "
                        f"its hold ends in {rec.hold_deadline - now:.1f} s: "
                        f"{rec.hold_source})", False, ends)
                return DrainBlocker(
                    f"request {rid} waits for its KV transfer ({now - started:.1f} s of "
                    f"the {bound:.0f} s bound)", False, ends)
        return None
