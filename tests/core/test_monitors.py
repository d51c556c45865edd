"""A feature written as a monitor (``kvguard.core.monitor``) gets the moments its Protocol
promises, in the documented order, and what it adds reaches what users read (the published
report and state). Ground truth: the reference pool's drain and the states the sink got."""

from __future__ import annotations

from _pool import Harness, RefAdapter
from _sinks import ListSink

from kvguard.config import KvguardConfig
from kvguard.core.monitor import MOMENTS, BaseMonitor, DrainBlocker, MonitorHost, overrides
from kvguard.core.report import CheckpointReport
from kvguard.core.session import GuardSession
from kvguard.core.types import FinishReason, RequestId


class Recorder(BaseMonitor):
    """Writes down each moment; adds a line to drained reports; may block a drain."""

    name = "recorder"

    def __init__(self, host: MonitorHost) -> None:
        self.host = host
        self.moments: list[str] = []
        self.block_until: float | None = None

    def on_request_admitted(self, request_id: RequestId, at: float) -> None:
        self.moments.append("admitted")

    def on_request_finished(self, request_id: RequestId, reason: FinishReason,
                            at: float) -> None:
        self.moments.append(f"finished {reason.value}")

    def on_request_freed(self, request_id: RequestId, at: float) -> None:
        self.moments.append("freed")

    def on_step_end(self, step_seconds: float | None) -> None:
        self.moments.append("step_end")

    def after_drain_check(self, step_seconds: float | None) -> None:
        drained = [r.checkpoint_id for r in self.host_reports() if r.drained]
        self.moments.append(f"after_drain_check drained={drained}")

    def drain_blocker(self, now: float) -> DrainBlocker | None:
        self.moments.append("drain_blocker")
        if self.block_until is not None and now < self.block_until:
            return DrainBlocker("the recorder holds it", False, self.block_until)
        return None

    def before_drained_audit(self, now: float) -> None:
        self.moments.append("before_drained_audit")

    def on_drained_report(self, report: CheckpointReport, now: float) -> CheckpointReport:
        self.moments.append("drained_report")
        return report.model_copy(update={"explanation": report.explanation + "\nRecorder: ok"})

    def on_report(self, report: CheckpointReport) -> None:
        self.moments.append(f"report {report.checkpoint_id}")

    def host_reports(self) -> list[CheckpointReport]:
        session = self.host
        assert isinstance(session, GuardSession)
        return list(session.reports)


def _session(h: Harness) -> tuple[GuardSession, ListSink, Recorder]:
    sink = ListSink()
    cfg = KvguardConfig.from_env({}, publish_interval_seconds=0.0, online_audit=False)
    s = GuardSession(RefAdapter(h), cfg, engine="ref0", sink=sink)
    h.ledger = s.ledger
    rec = Recorder(s)
    s.add_monitor(rec)
    return s, sink, rec


def test_a_monitor_hears_each_moment_in_order_and_its_part_reaches_the_published_report(
        ) -> None:
    h = Harness(32, lazy_claims=True)
    s, sink, rec = _session(h)
    r = h.admit()
    s.on_admitted(r.rid, h.t)
    h.allocate(r, 2, hash_mask=[True, False], attributed=True)
    s.on_step_end(step_seconds=0.01)  # busy: no drain check reaches the monitors
    h.finish(r, FinishReason.STOPPED, attributed=True)
    s.on_finished(r.rid, FinishReason.STOPPED, h.t)
    s.on_freed(r.rid, h.t)
    s.on_step_end(step_seconds=0.01)
    assert h.is_drained()
    assert rec.moments == [
        "admitted", "step_end", "after_drain_check drained=[]", "finished stopped", "freed",
        "step_end", "drain_blocker", "before_drained_audit", "drained_report", "report 1",
        "after_drain_check drained=[1]"]
    published = sink.states[-1].latest_report
    assert published is not None and published.drained
    assert published.explanation.endswith("\nRecorder: ok")


def test_a_monitor_can_hold_a_drain_until_its_bound_and_the_idle_engine_is_judged_then(
        ) -> None:
    h = Harness(32, lazy_claims=True)
    s, _, rec = _session(h)
    r = h.admit()
    h.allocate(r, 1, hash_mask=[False], attributed=False)
    h.finish(r, FinishReason.LENGTH, attributed=False)
    rec.block_until = 4e9  # far in the future
    s.on_release_done()
    s.on_step_end()
    assert not s.reports and s.drain_held_until == 4e9
    rec.block_until = None
    s.on_release_done()
    s.on_step_end()
    assert [rep.drained for rep in s.reports] == [True]


def test_only_the_moments_a_monitor_overrides_are_called() -> None:
    class StepOnly(BaseMonitor):
        name = "step_only"

        def on_step_end(self, step_seconds: float | None) -> None:
            return None

    m = StepOnly()
    assert [moment for moment in MOMENTS if overrides(m, moment)] == ["on_step_end"]
    h = Harness(16)
    s = GuardSession(RefAdapter(h), KvguardConfig.from_env({}, online_audit=False),
                     engine="ref0", sink=ListSink())
    before = s.monitors
    s.add_monitor(m)
    assert s.monitors == [*before, m]
    assert [moment for moment in MOMENTS if overrides(Recorder(s), moment)] == [
        "on_request_admitted", "on_request_finished", "on_request_freed", "on_step_end",
        "after_drain_check", "drain_blocker", "before_drained_audit", "on_drained_report",
        "on_report"]
