"""Memory attribution as a monitor: allocator, device and host memory at drained reports.

Watches: drained audits only (memory can be read as evidence only at a drained moment).
Adds: the memory sections of a drained report (``allocator``, ``device``, ``host``...;
:mod:`kvguard.attribution`); a failure is contained under ``attribution`` and the report
goes out without them.
Costs per step: nothing.
"""

from __future__ import annotations

from typing import Protocol

from kvguard.core.monitor import BaseMonitor, MonitorHost
from kvguard.core.report import CheckpointReport


class MemoryAttributor(Protocol):
    """Memory attribution (allocator, device, host) attached to a drained report."""

    def attach(self, report: CheckpointReport) -> CheckpointReport:
        """``report`` with its memory sections filled."""


class MemoryAttribution(BaseMonitor):
    """Runs the engine integration's :class:`MemoryAttributor` at each drained report."""

    name = "attribution"

    def __init__(self, host: MonitorHost, attributor: MemoryAttributor) -> None:
        self.host = host
        self.attributor = attributor

    def on_drained_report(self, report: CheckpointReport, now: float) -> CheckpointReport:
        # After the pool audit; a failure is contained and counted like a hook error.
        with self.host.contain(self.name):
            report = self.attributor.attach(report)
        return report
