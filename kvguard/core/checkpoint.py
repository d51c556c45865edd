"""Build a ``CheckpointReport`` from a reconciliation (or a reason to skip)."""

from __future__ import annotations

from kvguard.core.findings import Finding, Reconciliation
from kvguard.core.online import SweepResult
from kvguard.core.report import CheckpointReport, LeakReport, OnlineSweepReport, PoolReport
from kvguard.core.types import BlockState, Evidence, Verdict
from kvguard.core.verdict import decide, decide_online, skipped_explanation


def pool_report(rec: Reconciliation) -> PoolReport:
    c = rec.states.counts
    return PoolReport(
        capacity=rec.states.capacity,
        free=c[BlockState.FREE],
        cached=c[BlockState.CACHED],
        active=c[BlockState.ACTIVE],
        held_by_finished=c[BlockState.HELD_BY_FINISHED],
        orphaned=c[BlockState.ORPHANED],
        num_free_reported=rec.num_free_reported,
    )


def leak_report(f: Finding) -> LeakReport:
    return LeakReport(
        request_id=f.request_id,
        client_request_id=f.client_request_id,
        cause=f.cause,
        finish_reason=f.finish_reason,
        path=f.path,
        blocks=f.blocks,
        shared_blocks=f.shared_blocks,
        block_ids=list(f.block_ids),
        held_for_seconds=f.held_for_seconds,
        evidence=f.evidence,
        detail=f.detail,
    )


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
        pool=pool_report(rec),
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
