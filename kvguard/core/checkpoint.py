"""Build a ``CheckpointReport`` from a reconciliation (or a reason to skip)."""

from __future__ import annotations

from typing import TypedDict

from kvguard.core.findings import Finding, Reconciliation
from kvguard.core.online import SweepResult
from kvguard.core.report import CheckpointReport, LeakReport, OnlineSweepReport
from kvguard.core.types import Evidence, Verdict
from kvguard.core.verdict import decide, decide_online, skipped_explanation


class ReportStamp(TypedDict):
    """What every report of one engine carries to say where and when it was made: the
    engine's next checkpoint id (every report, drained or not, takes one), its name and
    run (``epoch``), and the Unix time (s) it was taken. Made in one place,
    :meth:`~kvguard.core.session.GuardSession.stamp`, and passed to the builders below as
    ``**stamp``."""

    checkpoint_id: int
    engine: str
    epoch: str
    taken_at: float


def leak_report(f: Finding) -> LeakReport:
    """The frozen report of a finding: ``LeakReport``'s fields read by name from the
    finding (one declaration, no copy by hand; a field the finding lacks is an error)."""
    return LeakReport.model_validate(f, from_attributes=True)


def build_report(
    rec: Reconciliation,
    *,
    checkpoint_id: int,
    engine: str,
    epoch: str,
    taken_at: float,
    saturation_ratio: float,
    audit_seconds: float = 0.0,
) -> CheckpointReport:
    """The report of a drained checkpoint."""
    verdict, explanation = decide(rec, saturation_ratio=saturation_ratio)
    return _judged_report(rec, verdict, explanation, checkpoint_id=checkpoint_id,
                          engine=engine, epoch=epoch, taken_at=taken_at, drained=True,
                          audit_seconds=audit_seconds)


def online_report(
    result: SweepResult,
    *,
    checkpoint_id: int,
    engine: str,
    epoch: str,
    taken_at: float,
    saturation_ratio: float,
    sweep: OnlineSweepReport,
) -> CheckpointReport:
    """The report of an online sweep (``evidence: online``, ``drained: false``)."""
    rec = result.reconciliation()
    verdict, explanation = decide_online(
        rec, sweep_steps=sweep.sweep_steps, sweep_seconds=sweep.sweep_seconds,
        saturation_ratio=saturation_ratio)
    return _judged_report(rec, verdict, explanation, checkpoint_id=checkpoint_id,
                          engine=engine, epoch=epoch, taken_at=taken_at, drained=False,
                          audit_seconds=result.busy_seconds, evidence=Evidence.ONLINE,
                          online=sweep)


def _judged_report(
    rec: Reconciliation, verdict: Verdict, explanation: str, *, checkpoint_id: int,
    engine: str, epoch: str, taken_at: float, drained: bool, audit_seconds: float,
    evidence: Evidence = Evidence.DRAINED, online: OnlineSweepReport | None = None,
) -> CheckpointReport:
    return CheckpointReport(
        checkpoint_id=checkpoint_id,
        engine=engine,
        epoch=epoch,
        taken_at=taken_at,
        drained=drained,
        verdict=verdict,
        pool=rec.states,
        saturation_ratio=min(1.0, rec.states.saturation_ratio),
        finished_requests_holding_blocks=rec.finished_requests_holding,
        leaks=[leak_report(f) for f in rec.findings],
        leaked_blocks=rec.leaked_blocks(),
        leaked_blocks_by_cause=rec.leaked_blocks_by_cause(),
        explanation=explanation,
        audit_seconds=audit_seconds,
        evidence=evidence,
        online=online,
    )


def skipped_report(
    reason: str, *, checkpoint_id: int, engine: str, epoch: str, taken_at: float
) -> CheckpointReport:
    return CheckpointReport(
        checkpoint_id=checkpoint_id,
        engine=engine,
        epoch=epoch,
        taken_at=taken_at,
        drained=False,
        verdict=Verdict.SKIPPED,
        skip_reason=reason,
        explanation=skipped_explanation(reason),
    )
