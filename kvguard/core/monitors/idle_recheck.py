"""Idle re-checks as a monitor: an idle engine's verdict stays current without traffic.

Watches: drained audits (when the last one ran) and the idle wake-ups.
Adds: nothing of its own to the report or the state; it makes an idle engine audit again
``idle_recheck_seconds`` (``KVGUARD_IDLE_RECHECK_SECONDS``; 0: never) after its last drained
audit, by arming the session's idle waker.
Costs per step: nothing (it acts at drained audits and idle wake-ups only).
"""

from __future__ import annotations

import time

from kvguard.core.monitor import BaseMonitor, MonitorHost
from kvguard.core.report import CheckpointReport


class IdleRecheck(BaseMonitor):
    """Asks for a drained audit when an idle engine's last one is ``idle_recheck_seconds`` old."""

    name = "idle"

    def __init__(self, host: MonitorHost) -> None:
        self.host = host
        self.last_drained_mono: float | None = None
        """When the last drained audit ran (monotonic s)."""

    def on_drained_report(self, report: CheckpointReport, now: float) -> CheckpointReport:
        self.last_drained_mono = time.monotonic()
        every = self.host.config.idle_recheck_seconds
        if every > 0:
            # Idle from here on, the waker brings on_idle back then (a busy engine drains,
            # and is audited, before that; the waker keeps only the earliest wake).
            self.host.wake_after(every)
        return report

    def on_idle(self) -> bool:
        every = self.host.config.idle_recheck_seconds
        last = self.last_drained_mono
        return every > 0 and last is not None and time.monotonic() - last >= every
