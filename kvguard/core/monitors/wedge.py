"""The wedge verdict as a monitor: an engine that serves nothing because dead owners hold
the blocks its waiting requests need.

Watches: at every step end (after the drain decision), what waits in the engine (through
its :class:`~kvguard.core.wedge_monitor.WaitingSource`) and, once a stall passes both
thresholds, the dead owners the session's ledger, offload audit and online audit prove
(:func:`~kvguard.core.wedge_monitor.session_dead_owners`).
Adds: the ``wedge`` section of the published state (the current verdict, verdicts named,
the stall); the sidecar turns it into ``/v1/ready`` and ``kvguard_engine_wedged``.
Costs per step: the length of the engine's waiting queue while nothing waits (about
0.2 us, docs/wedge.md); while requests wait, the queue's head and two counts, and the dead
owners at most every 0.5 s once the stall passed the thresholds. Its failures are counted
under hook ``wedge`` (never a ledger error) and the engine goes on.
"""

from __future__ import annotations

from kvguard.core.monitor import BaseMonitor, MonitorHost, StateSection
from kvguard.core.wedge_monitor import WedgeMonitor


class WedgeWatch(BaseMonitor):
    """Runs a :class:`~kvguard.core.wedge_monitor.WedgeMonitor` at the session's step ends."""

    name = "wedge"

    def __init__(self, host: MonitorHost, wedge: WedgeMonitor) -> None:
        self.host = host
        self.wedge = wedge

    def after_drain_check(self, step_seconds: float | None) -> None:
        try:  # not host.contain: this runs every step, and a bare try costs nothing
            self.wedge.on_step_end(stepped=step_seconds is not None)
        except Exception as exc:
            self.host.errors.record(self.name, exc)

    def state_section(self) -> StateSection:
        return {"wedge": self.wedge.state()}
