"""The KV-event mirror check's engine side as a monitor (:mod:`kvguard.kv_events`).

Watches: drained audits: at each, it takes the pool's hashed blocks and the last batch
handed to the engine's KV-event publisher, at the same moment and on the same thread, so
the sidecar can compare a subscriber's mirror with the pool at one point of the stream.
Adds: the ``kv_events`` section of the state (the stream's counters with that snapshot).
A failing source is contained under ``kv_events``.
Costs per step: nothing (a snapshot per drained audit; the section at each publish).
"""

from __future__ import annotations

from typing import Protocol

from kvguard.core.monitor import BaseMonitor, MonitorHost, StateSection
from kvguard.core.report import CheckpointReport
from kvguard.kv_events.snapshot import KvEventsSnapshot, KvEventsState


class KvEventsSource(Protocol):
    """The engine's KV-event stream and its pool's hashed blocks (the KV-event mirror check,
    :mod:`kvguard.kv_events`); set by the engine integration when the engine publishes
    KV events."""

    def snapshot(self, checkpoint_id: int, taken_at: float) -> KvEventsSnapshot:
        """The pool's hashed blocks now, with the last batch handed to the publisher."""

    def state(self, snapshot: KvEventsSnapshot | None) -> KvEventsState:
        """The stream's counters, with ``snapshot``."""


class KvEventsMirror(BaseMonitor):
    """Snapshots the pool's hashed blocks at drained reports and publishes the stream's state."""

    name = "kv_events"

    def __init__(self, host: MonitorHost, source: KvEventsSource) -> None:
        self.host = host
        self.source = source
        self.snapshot: KvEventsSnapshot | None = None
        """Read at the last drained checkpoint."""

    def on_drained_report(self, report: CheckpointReport, now: float) -> CheckpointReport:
        with self.host.contain(self.name):  # same moment, same thread: one point of the stream
            self.snapshot = self.source.snapshot(report.checkpoint_id, now)
        return report

    def state_section(self) -> StateSection:
        try:
            return {"kv_events": self.source.state(self.snapshot)}
        except Exception as exc:
            self.host.errors.record(self.name, exc)
            return {}
