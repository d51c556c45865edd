"""The online audit as a monitor: leaks found under load, between engine steps, no drain needed.

Watches: every step's scheduler time (``step_seconds``), of which it may spend a fraction
(``KVGUARD_ONLINE_BUDGET_FRACTION``) sweeping the pool slice by slice against the ledger
(:class:`~kvguard.core.online.OnlineAuditor`); drained reports (which it never
contradicts with findings it has not had the time to confirm).
Adds: an ``online`` report when its confirmed findings change; the ``online`` section of
the state (sweeps, budget, detection latency). After a contained hook failure under load
it has the session rebuild the ledger from the engine's block tables.
Costs per step: its budget (a fraction of the step's scheduler time, carried as credit);
one comparison when the step earned no work.
"""

from __future__ import annotations

import time

from kvguard.config import KvguardConfig
from kvguard.core.checkpoint import online_report
from kvguard.core.monitor import BaseMonitor, MonitorHost, StateSection
from kvguard.core.online import OnlineAuditor, OnlineOptions, SweepResult
from kvguard.core.report import CheckpointReport, OnlineSweepReport
from kvguard.core.state import OnlineState

FindingsKey = frozenset[tuple[str, str | None, str, int]]
"""What a report says about leaks: cause, request, path, blocks per finding."""


def findings_key(report: CheckpointReport) -> FindingsKey:
    """What a report says about leaks, for "has anything changed"."""
    return frozenset((f.cause.value, f.request_id, f.path.value, f.blocks)
                     for f in report.leaks)


def online_options(config: KvguardConfig, delayed_free_bound: float) -> OnlineOptions:
    return OnlineOptions(budget_fraction=config.online_budget_fraction,
                         max_pause_seconds=config.online_max_pause_seconds,
                         delayed_free_bound_seconds=delayed_free_bound)


class OnlineAudit(BaseMonitor):
    """Spends the online auditor's budget at step ends and reports what it confirms."""

    name = "online"

    def __init__(self, host: MonitorHost) -> None:
        self.host = host
        self.auditor = OnlineAuditor(host.adapter.pool, host.ledger,
                                     online_options(host.config, host.delayed_free_bound))
        self._key: FindingsKey | None = None
        """The findings of the last report (online or drained): online reports only on change."""
        self._quiet_until = 0
        """No online report before this many sweeps (set by drained checkpoints)."""

    def on_config_changed(self, config: KvguardConfig) -> None:
        opts = online_options(config, self.host.delayed_free_bound)
        self.auditor.opts = opts
        self.auditor.budget.fraction = opts.budget_fraction
        self.auditor.budget.max_credit = opts.max_pause_seconds

    def after_drain_check(self, step_seconds: float | None) -> None:
        if step_seconds is not None and self.auditor.tick(step_seconds):
            self._step()

    def _step(self) -> None:
        """Spend the credit this step earned (``OnlineAuditor.tick``)."""
        if self.host.ledger_errors_since_checkpoint():
            self.host.resync_ledger()
        result = self.auditor.work(time.time())
        if result is not None:
            t0 = time.perf_counter()
            self._on_sweep(result)
            self.auditor.charge(time.perf_counter() - t0)  # its report is the audit's cost too

    def _on_sweep(self, result: SweepResult) -> None:
        host = self.host
        host.last_pool = result.states
        if not result.can_confirm or self.auditor.stats.sweeps_total < self._quiet_until:
            return
        key = frozenset((f.cause.value, f.request_id, f.path.value, f.blocks)
                        for f in result.findings)
        if key == self._key:
            return  # nothing new to say
        self._key = key
        host.record(online_report(
            result, **host.stamp(time.time()), saturation_ratio=host.config.saturation_ratio,
            sweep=self._sweep_report(result)))

    def _sweep_report(self, result: SweepResult) -> OnlineSweepReport:
        return OnlineSweepReport(
            sweep_steps=result.steps, sweep_seconds=result.seconds,
            audit_seconds=result.busy_seconds,
            budget_fraction=self.auditor.opts.budget_fraction,
            detection_latency_steps=3 * result.steps,
            detection_latency_seconds=3 * result.seconds,
            delayed_free_bound_seconds=self.auditor.opts.delayed_free_bound_seconds)

    def on_drained_report(self, report: CheckpointReport, now: float) -> CheckpointReport:
        # A drained audit supersedes what the online audit reported: the online audit
        # reports again only when its confirmed findings differ from these, and not
        # before every block was audited twice after this checkpoint (the sweep in
        # progress, then two full ones), so that it never contradicts the drained
        # verdict with findings it has not had the time to confirm. Its sweep goes on
        # (suspects stay comparable: the ledger was not reset).
        self._key = findings_key(report)
        self._quiet_until = self.auditor.stats.sweeps_total + 3
        return report

    def on_ledger_reset(self) -> None:
        self.auditor.restart()  # its suspects refer to the old records

    def state(self) -> OnlineState:
        online = self.auditor
        st = online.stats
        return OnlineState(
            budget_fraction=online.opts.budget_fraction,
            sweeps_total=st.sweeps_total,
            audit_seconds_total=st.busy_seconds_total,
            blocks_audited_total=st.blocks_audited_total,
            last_sweep_steps=st.last_sweep_steps,
            last_sweep_seconds=st.last_sweep_seconds,
            last_sweep_at=st.last_sweep_at,
            detection_latency_steps=3 * st.last_sweep_steps,
            detection_latency_seconds=3 * st.last_sweep_seconds,
            pending_blocks=online.pending_blocks,
            confirmed_blocks=len(online.confirmed),
            restarts_total=st.restarts_total,
        )

    def state_section(self) -> StateSection:
        return {"online": self.state()}
