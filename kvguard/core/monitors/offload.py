"""The offload job audit as a monitor (an offloading KV connector's jobs and tier).

Watches: the connector's jobs in flight and its tier counts, read at most every
``TRANSFER_POLL_SECONDS`` at step ends, at each idle wake-up and at each drained audit
(where the tier is also reconciled with the jobs in flight).
Adds: the ``offload`` section of the state (:class:`~kvguard.core.offload.OffloadState`);
a drained report whose offload verdict is not ``ok`` gets an "Offload path:" line in its
explanation. Each job is logged the first time it is stuck. Failures are contained under
``offload``.
Costs per step: one monotonic clock read (the read itself at most 4 times a second).
"""

from __future__ import annotations

import logging
import time

from kvguard.config import KvguardConfig
from kvguard.core.engine import HoldBound
from kvguard.core.monitor import BaseMonitor, MonitorHost, StateSection
from kvguard.core.monitors.transfers import TRANSFER_POLL_SECONDS
from kvguard.core.offload import OffloadAudit, OffloadSource, OffloadState, OffloadVerdict
from kvguard.core.report import CheckpointReport

log = logging.getLogger("kvguard")


def offload_bound(config: KvguardConfig, hold_bound: HoldBound) -> tuple[float, str]:
    """Seconds an offload job may stay in flight, and where the number comes from."""
    if config.offload_job_bound_seconds is not None:
        return config.offload_job_bound_seconds, "KVGUARD_OFFLOAD_JOB_BOUND_SECONDS"
    configured = config.delayed_free_bound_seconds
    if configured is not None:
        return configured, "the delayed-free bound (KVGUARD_DELAYED_FREE_BOUND_SECONDS)"
    return hold_bound.seconds, f"the delayed-free bound ({hold_bound.source})"


class OffloadMonitor(BaseMonitor):
    """Reads the offload path and judges it (:class:`~kvguard.core.offload.OffloadAudit`)."""

    name = "offload"

    def __init__(self, host: MonitorHost, source: OffloadSource, hold_bound: HoldBound) -> None:
        self.host = host
        self.source = source
        self.hold_bound = hold_bound
        self.audit = OffloadAudit(source.connector, *offload_bound(host.config, hold_bound))
        self._next_poll = 0.0

    def poll(self, *, drained_at: float | None = None) -> OffloadState | None:
        """Read the offload path and judge it (``drained_at``, Unix s: also reconcile the
        tier with the jobs in flight). None when the read failed (contained)."""
        audit = self.audit
        with self.host.contain(self.name):
            reading = self.source.read()
            if drained_at is not None:
                audit.reconcile(reading, drained_at)
            before = audit.stuck_jobs_total
            state = audit.judge(reading)
            if audit.stuck_jobs_total > before:
                log.warning("kvguard: engine %s offload %s: %s", self.host.engine,
                            state.verdict.value, state.explanation.splitlines()[0])
            return state
        return None

    def on_step_end(self, step_seconds: float | None) -> None:
        mono = time.monotonic()
        if mono >= self._next_poll:
            self._next_poll = mono + TRANSFER_POLL_SECONDS
            self.poll()

    def on_idle(self) -> bool:
        self.poll()
        return False

    def on_drained_report(self, report: CheckpointReport, now: float) -> CheckpointReport:
        offload = self.poll(drained_at=now)
        if offload is not None and offload.verdict is not OffloadVerdict.OK:
            report = report.model_copy(update={"explanation": report.explanation
                                               + "\nOffload path: " + offload.explanation})
        return report

    def on_config_changed(self, config: KvguardConfig) -> None:
        self.audit.bound_seconds, self.audit.bound_source = offload_bound(config,
                                                                          self.hold_bound)

    def state_section(self) -> StateSection:
        return {"offload": self.audit.last}
