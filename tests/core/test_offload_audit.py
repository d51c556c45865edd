"""The offload audit's judgement and tier reconciliation, on hand-made readings."""

from __future__ import annotations

from _pool import Harness, RefAdapter
from _sinks import ListSink

from kvguard.config import KvguardConfig
from kvguard.core.offload import (
    MAX_LISTED,
    JobKind,
    OffloadAudit,
    OffloadJob,
    OffloadReading,
    OffloadTier,
    OffloadVerdict,
    WaitingRequest,
)
from kvguard.core.session import GuardSession
from kvguard.core.types import Verdict


def job(job_id: int, age: float, kind: JobKind = JobKind.STORE, steps: int = 10,
        chunks: int = 5) -> OffloadJob:
    return OffloadJob(job_id=job_id, kind=kind, request_id=f"r{job_id}-abcd",
                      client_request_id=f"r{job_id}", request_finished=True, chunks=chunks,
                      fenced_blocks=chunks, age_seconds=age, age_steps=steps)


TIER = OffloadTier(capacity=100, ready=10, read_pinned=0, write_pending=5, free=85)


def test_a_job_past_the_bound_is_stuck_and_named_with_its_waiters() -> None:
    audit = OffloadAudit("OffloadingConnector", 2.0, "test")
    waiting = [WaitingRequest(request_id="w-1", client_request_id="w", waited_seconds=1.5)]
    state = audit.judge(OffloadReading([job(1, 1.0)], TIER, waiting))
    assert state.verdict is OffloadVerdict.OK and state.jobs_in_flight == {"store": 1, "load": 0}
    state = audit.judge(OffloadReading([job(1, 2.5), job(2, 0.1)], TIER, waiting))
    assert state.verdict is OffloadVerdict.STUCK
    assert [j.job_id for j in state.stuck] == [1] and state.stuck_jobs == 1
    assert "store job 1 of request r1" in state.explanation
    assert "never goes idle" in state.explanation and "w" in state.explanation
    assert state.waiting_requests == 1 and state.oldest_job_age_seconds == 2.5
    # Seen stuck again: counted once; gone: the verdict clears, the total stays.
    audit.judge(OffloadReading([job(1, 3.0)], TIER, waiting))
    state = audit.judge(OffloadReading([], TIER, []))
    assert state.verdict is OffloadVerdict.OK and state.stuck_jobs_total == 1


def test_an_engine_that_did_not_step_does_not_make_a_job_stuck() -> None:
    audit = OffloadAudit("OffloadingConnector", 1.0, "test")
    assert audit.judge(OffloadReading([job(1, 50.0, steps=1)], TIER, [])).verdict \
        is OffloadVerdict.OK


def test_the_list_is_bounded_and_oldest_first() -> None:
    audit = OffloadAudit("OffloadingConnector", 1.0, "test")
    state = audit.judge(OffloadReading([job(i, 2.0 + i) for i in range(50)], None, []))
    assert state.stuck_jobs == 50 and len(state.stuck) == MAX_LISTED
    assert state.stuck[0].job_id == 49


def test_reconciliation_at_a_drain() -> None:
    audit = OffloadAudit("OffloadingConnector", 30.0, "test")
    assert audit.reconcile(OffloadReading([job(1, 0.1)], TIER, []), at=1.0) is None
    assert audit.judge(OffloadReading([], TIER, [])).verdict is OffloadVerdict.OK
    # Write-pending chunks with no store job in flight: a completion was applied to the
    # jobs but not to the tier (or the other way round).
    why = audit.reconcile(OffloadReading([], TIER, []), at=2.0)
    assert why is not None and "5 write-pending chunks" in why
    state = audit.judge(OffloadReading([], TIER, []))
    assert state.verdict is OffloadVerdict.TIER_MISMATCH and state.tier_checked_at == 2.0
    pinned = OffloadTier(capacity=100, ready=10, read_pinned=3, write_pending=0, free=90)
    why = audit.reconcile(OffloadReading([job(2, 0.1, JobKind.LOAD, chunks=2)], pinned, []), 3.0)
    assert why is not None and "3 read-pinned" in why
    assert audit.reconcile(OffloadReading([], None, []), 4.0) is None  # no tier counts


# ------------------------------------------------------------ in a guard session

class _Source:
    """An offload source with one store job (or one that fails every read)."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.reads = 0

    @property
    def connector(self) -> str:
        return "OffloadingConnector"

    def read(self) -> OffloadReading:
        self.reads += 1
        if self.fail:
            raise RuntimeError("connector layout changed")
        return OffloadReading([job(1, 100.0)], TIER, [])


class _OffloadAdapter(RefAdapter):
    def __init__(self, h: Harness, source: _Source) -> None:
        super().__init__(h)
        self.source = source

    def offload_source(self) -> _Source:
        return self.source


def _session(source: _Source) -> tuple[GuardSession, ListSink]:
    h = Harness(64, lazy_claims=True)
    sink = ListSink()
    cfg = KvguardConfig.from_env({}, publish_interval_seconds=0.0, online_audit=False,
                                 offload_job_bound_seconds=5.0)
    s = GuardSession(_OffloadAdapter(h, source), cfg, engine="ref0", sink=sink)
    h.ledger = s.ledger
    r = h.admit()
    h.allocate(r, 3, hash_mask=[True, True, False], attributed=False)
    h.drain(attributed=False)
    s.on_release_done()
    s.on_step_end()
    return s, sink


def test_a_drained_checkpoint_reconciles_the_tier_and_says_a_job_is_stuck() -> None:
    s, sink = _session(_Source())
    report = s.reports[-1]
    assert report.drained and report.verdict in (Verdict.CLEAN, Verdict.SATURATED)
    assert "Offload path: 1 offload job(s) in flight past the 5 s bound" in report.explanation
    offload = sink.states[-1].offload
    assert offload is not None and offload.verdict is OffloadVerdict.STUCK
    assert offload.bound_source == "KVGUARD_OFFLOAD_JOB_BOUND_SECONDS"
    assert offload.tier_checked_at == report.taken_at and offload.tier_mismatch is None


def test_a_failing_offload_source_is_contained_and_the_checkpoint_still_judged() -> None:
    source = _Source(fail=True)
    s, sink = _session(source)
    report = s.reports[-1]
    assert report.drained and report.verdict in (Verdict.CLEAN, Verdict.SATURATED)
    assert source.reads >= 1 and s.errors.by_hook["offload"] == source.reads
    assert s.errors.ledger_errors == 0 and sink.states[-1].offload is None
