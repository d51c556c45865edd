"""What the session makes up for without some engine events (kvguard/core/fail_soft.py), on
the ledger alone; tests/scheduler/test_fail_soft.py checks the same against vLLM's own pool."""

from __future__ import annotations

from kvguard.core.fail_soft import EventsSeen, settle_records
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.types import AcquireKind, FinishReason, RequestId, RequestPhase

A, B, C = RequestId("a"), RequestId("b"), RequestId("c")


def test_release_request_gives_back_every_reference_and_counts_no_double_free() -> None:
    ledger = OwnershipLedger()
    for rid in (A, B):
        ledger.on_request_admitted(rid, 0.0)
    ledger.on_blocks_acquired(A, [1, 2], AcquireKind.ALLOCATE)
    ledger.on_blocks_acquired(B, [2, 3], AcquireKind.PREFIX_HIT)  # block 2 shared
    ledger.release_request(A)
    assert ledger.owners_of(2) == {B: 1} and ledger.owners_of(1) == {}
    assert ledger.num_double_frees == 0 and ledger.num_events["release"] == 0
    ledger.on_request_finished(B, FinishReason.STOPPED, 1.0)
    ledger.on_request_freed(B, 1.0)
    ledger.release_request(B)  # freed, nothing held: compacted
    assert ledger.record(B) is None and ledger.owned_block_ids() == set()


def test_settle_finishes_and_frees_only_what_the_engine_no_longer_keeps() -> None:
    ledger = OwnershipLedger()
    for rid in (A, B, C):
        ledger.on_request_admitted(rid, 0.0)
    ledger.on_blocks_acquired(A, [1], AcquireKind.ALLOCATE)  # dropped holding a block
    ledger.on_request_finished(C, FinishReason.LENGTH, 1.0)  # kept (a delayed free)
    seen = EventsSeen(finishes=False, frees=False)
    assert seen.settles_at_audit and not EventsSeen().settles_at_audit
    assert settle_records(ledger, frozenset({str(C)}), seen, 2.0) == 2
    a = ledger.record(A)
    assert a is not None and a.phase is RequestPhase.FINISHED  # its block: evidence
    assert a.finish_reason is FinishReason.UNKNOWN and a.freed_at == 2.0
    assert ledger.record(B) is None  # finished, freed, holding nothing: gone
    c = ledger.record(C)
    assert c is not None and c.freed_at is None  # the engine keeps it: left alone


def test_settle_with_finishes_seen_frees_finished_records_only() -> None:
    ledger = OwnershipLedger()
    for rid in (A, B):
        ledger.on_request_admitted(rid, 0.0)
    ledger.on_request_finished(A, FinishReason.ABORTED, 1.0)
    assert settle_records(ledger, frozenset(), EventsSeen(frees=False), 2.0) == 1
    assert ledger.record(A) is None
    b = ledger.record(B)
    assert b is not None and b.phase is RequestPhase.WAITING  # no finish was missed
