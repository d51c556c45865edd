"""One explicit test per row of the reconciler's table (``kvguard.core.reconciler``).

Each test builds the smallest pool snapshot and ledger that put one block in
the row's condition, and checks the block's state and the finding (cause,
request, path, block count). Block 0 is the null block in every snapshot and
carries a garbage ref count, which must never be counted.
"""

from __future__ import annotations

import pytest

from kvguard.core.findings import MAX_BLOCK_IDS_PER_FINDING
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.snapshot import PoolSnapshot
from kvguard.core.types import (
    AcquireKind,
    BlockState,
    Evidence,
    FinishReason,
    LeakCause,
    LeakPath,
    RequestId,
    Verdict,
)
from kvguard.core.verdict import decide
from kvguard.errors import CorruptStateError
from kvguard.vllm_plugin.request_ids import client_request_id

NULL_GARBAGE = 5


def vllm_ledger() -> OwnershipLedger:
    """A ledger that maps vLLM-style ids (``a-0000000a``) to client ids, as vLLM's adapter."""
    return OwnershipLedger(client_id_of=client_request_id)


A = RequestId("a-0000000a")
B = RequestId("b-0000000b")
NOW = 1_000.0


def snap(
    refs: list[int],
    *,
    cached: set[int] = frozenset(),
    in_queue: set[int] | None = None,
    walk: bool = True,
    num_free_reported: int | None = None,
) -> PoolSnapshot:
    """``refs`` are blocks 1..n; block 0 (null) is prepended with a garbage ref count."""
    ref_counts = [NULL_GARBAGE, *refs]
    n = len(ref_counts)
    if in_queue is None:
        in_queue = {b for b in range(1, n) if ref_counts[b] == 0}
    return PoolSnapshot(
        ref_counts=ref_counts,
        cached=[b in cached for b in range(n)],
        num_free_reported=len(in_queue) if num_free_reported is None else num_free_reported,
        in_free_queue=[b in in_queue for b in range(n)] if walk else None,
    )


def audit(s: PoolSnapshot, ledger: OwnershipLedger, **opts):
    rec = reconcile(s, ledger, ReconcileOptions(now=NOW, **opts))
    assert rec.states.total == s.capacity, "states must sum to capacity"
    return rec


def rows(rec) -> list[tuple]:
    return [(f.cause, f.request_id, f.path, f.blocks, sorted(f.block_ids)) for f in rec.findings]


def live(*, rid: RequestId = A, blocks=(1,), ledger: OwnershipLedger | None = None):
    ledger = ledger or vllm_ledger()
    ledger.on_request_admitted(rid, NOW - 10)
    ledger.on_blocks_acquired(rid, list(blocks), AcquireKind.ALLOCATE)
    return ledger


# ------------------------------------------------------------------ the rows
def test_row_ref0_no_owner_hashed_is_cached_without_finding() -> None:
    rec = audit(snap([0, 0], cached={1}), vllm_ledger())
    assert rec.states[BlockState.CACHED] == 1
    assert rec.states[BlockState.FREE] == 1
    assert rec.findings == []


def test_row_ref0_no_owner_not_hashed_is_free_without_finding() -> None:
    rec = audit(snap([0, 0, 0]), vllm_ledger())
    assert rec.states[BlockState.FREE] == 3
    assert rec.findings == []
    assert decide(rec)[0] is Verdict.CLEAN


def test_row_ref0_but_owned_is_a_double_free_naming_the_culprit() -> None:
    # A and B share block 1; A releases it twice: ref 0 while B still uses it.
    ledger = live(rid=A)
    ledger.on_blocks_acquired(B, [1], AcquireKind.PREFIX_HIT)
    ledger.on_request_finished(A, FinishReason.STOPPED, NOW - 1)
    ledger.on_blocks_released(A, [1])
    ledger.on_blocks_released(A, [1])
    rec = audit(snap([0], cached={1}), ledger)
    assert rec.states[BlockState.CACHED] == 1
    assert rows(rec) == [(LeakCause.DOUBLE_FREE, A, LeakPath.FINISH, 1, [1])]
    assert "still held by b" in rec.findings[0].detail


def test_row_negative_ref_is_a_double_free_and_orphaned() -> None:
    ledger = live(rid=A)
    ledger.on_request_finished(A, FinishReason.ABORTED, NOW - 1)
    ledger.on_blocks_released(A, [1])
    ledger.on_blocks_released(A, [1])
    rec = audit(snap([-1], in_queue={1}), ledger)
    assert rec.states[BlockState.ORPHANED] == 1
    assert rows(rec) == [(LeakCause.DOUBLE_FREE, A, LeakPath.ABORT, 1, [1])]
    assert rec.num_free_observed == 0 and rec.num_free_reported == 1


def test_row_referenced_block_in_the_free_queue_is_a_double_free() -> None:
    ledger = live(rid=A)
    rec = audit(snap([1], in_queue={1}), ledger)
    assert rec.states[BlockState.ACTIVE] == 1
    assert rows(rec) == [(LeakCause.DOUBLE_FREE, None, LeakPath.UNKNOWN, 1, [1])]


def test_row_live_owner_with_matching_ref_is_active_without_finding() -> None:
    ledger = live(rid=A, blocks=(1, 2))
    ledger.on_request_admitted(B, NOW - 5)
    ledger.on_blocks_acquired(B, [2], AcquireKind.PREFIX_HIT)
    rec = audit(snap([1, 2, 0]), ledger)
    assert rec.states[BlockState.ACTIVE] == 2
    assert rec.findings == []


def test_row_live_owner_with_a_different_ref_is_refcount_drift() -> None:
    ledger = live(rid=A, blocks=(1,))
    rec = audit(snap([3]), ledger)
    assert rec.states[BlockState.ACTIVE] == 1
    assert rows(rec) == [(LeakCause.REFCOUNT_DRIFT, A, LeakPath.UNKNOWN, 1, [1])]
    assert "ref_cnt 3 but 1 known references" in rec.findings[0].detail


def test_row_only_finished_owners_is_held_by_finished_and_a_finished_request_leak() -> None:
    ledger = live(rid=A, blocks=(1, 2))
    ledger.on_request_preempted(A)
    ledger.on_request_finished(A, FinishReason.STOPPED, NOW - 12)
    ledger.on_request_freed(A, NOW - 12)
    rec = audit(snap([1, 1, 0]), ledger)
    assert rec.states[BlockState.HELD_BY_FINISHED] == 2
    assert rows(rec) == [(LeakCause.FINISHED_REQUEST, A, LeakPath.PREEMPTION, 2, [1, 2])]
    f = rec.findings[0]
    assert f.held_for_seconds == pytest.approx(12.0)
    assert f.finish_reason is FinishReason.STOPPED
    assert f.client_request_id == "a"
    assert rec.finished_requests_holding == 1


def test_row_finished_owner_in_a_young_delayed_free_is_not_a_leak() -> None:
    ledger = live(rid=A, blocks=(1,))
    ledger.on_request_finished(A, FinishReason.STOPPED, NOW - 5)
    ledger.on_delayed_free_started(A, NOW - 5)
    rec = audit(snap([1]), ledger, delayed_free_bound_seconds=30.0)
    assert rec.states[BlockState.HELD_BY_FINISHED] == 1
    assert rec.findings == []
    assert rec.finished_requests_holding == 1


def test_row_finished_owner_past_its_delayed_free_bound_is_a_delayed_free_leak() -> None:
    ledger = live(rid=A, blocks=(1,))
    ledger.on_request_finished(A, FinishReason.STOPPED, NOW - 45)
    ledger.on_delayed_free_started(A, NOW - 45)
    rec = audit(snap([1]), ledger, delayed_free_bound_seconds=30.0)
    assert rows(rec) == [(LeakCause.FINISHED_REQUEST, A, LeakPath.DELAYED_FREE, 1, [1])]


def test_a_completed_delayed_free_leaves_nothing_behind() -> None:
    ledger = live(rid=A, blocks=(1,))
    ledger.on_request_finished(A, FinishReason.STOPPED, NOW - 45)
    ledger.on_delayed_free_started(A, NOW - 45)
    ledger.on_blocks_released(None, [1])  # the transfer completed: the free arrives
    ledger.on_request_freed(A, NOW - 1)
    assert ledger.num_records == 0
    assert audit(snap([0]), ledger).findings == []


def test_row_referenced_without_owner_is_an_orphan() -> None:
    rec = audit(snap([1, 0]), vllm_ledger())
    assert rec.states[BlockState.ORPHANED] == 1
    assert rows(rec) == [(LeakCause.ORPHAN, None, LeakPath.UNKNOWN, 1, [1])]


@pytest.mark.parametrize(
    ("kind", "path"),
    [(AcquireKind.PREFIX_HIT, LeakPath.PREFIX_HIT), (AcquireKind.ALLOCATE, LeakPath.ROLLBACK)],
)
def test_row_unclaimed_pool_reference_is_an_orphan_on_its_path(
    kind: AcquireKind, path: LeakPath
) -> None:
    # The pool hook saw the acquisition, no request ever claimed it (a failed
    # admission that did not roll back).
    ledger = vllm_ledger()
    ledger.on_blocks_acquired(None, [2], kind)
    rec = audit(snap([0, 1]), ledger)
    assert rec.states[BlockState.ORPHANED] == 1
    assert rows(rec) == [(LeakCause.ORPHAN, None, path, 1, [2])]


def test_row_unreferenced_block_missing_from_the_free_queue_is_an_unreachable_orphan() -> None:
    rec = audit(snap([0, 0], in_queue={1}), vllm_ledger())
    assert rec.states[BlockState.ORPHANED] == 1
    assert rows(rec) == [(LeakCause.ORPHAN, None, LeakPath.UNKNOWN, 1, [2])]
    assert "never be allocated again" in rec.findings[0].detail


# --------------------------------------------------- around the table
def test_the_null_block_is_never_counted_whatever_its_ref_count() -> None:
    s = snap([0, 0])
    assert s.capacity == 2 and s.num_blocks == 3
    rec = audit(s, vllm_ledger())
    assert rec.states.capacity == 2
    assert rec.findings == []
    assert rec.num_free_observed == 2


def test_without_a_free_queue_walk_more_reported_free_than_unreferenced_is_a_double_free() -> None:
    rec = audit(snap([0, 1], walk=False, num_free_reported=2), live(rid=A, blocks=(2,)))
    assert rows(rec) == [(LeakCause.DOUBLE_FREE, None, LeakPath.UNKNOWN, 1, [])]


def test_without_a_free_queue_walk_fewer_reported_free_than_unreferenced_is_an_orphan() -> None:
    rec = audit(snap([0, 0, 0], walk=False, num_free_reported=1), vllm_ledger())
    assert rows(rec) == [(LeakCause.ORPHAN, None, LeakPath.UNKNOWN, 2, [])]


def test_a_free_count_mismatch_does_not_erase_a_stray_reference_finding() -> None:
    """Block 1 has a stray reference; one unreferenced block fell out of the free queue.

    Two orphaned blocks, two causes of evidence: both must be in the findings.
    """
    rec = audit(snap([1, 0, 0], walk=False, num_free_reported=1), vllm_ledger())
    assert rec.leaked_blocks_by_cause()[LeakCause.ORPHAN] == 2, rec.findings
    assert any(1 in f.block_ids for f in rec.findings), rec.findings


def test_a_double_freed_block_is_named_and_counted_once_without_a_free_queue_walk() -> None:
    ledger = vllm_ledger()
    ledger.on_blocks_acquired(None, [1], AcquireKind.ALLOCATE)
    ledger.on_blocks_released(None, [1])
    ledger.on_blocks_released(None, [1])  # ref -1, still in the free queue
    rec = audit(snap([-1, 0], walk=False, num_free_reported=2), ledger)
    assert any(1 in f.block_ids for f in rec.findings), rec.findings
    assert rec.leaked_blocks_by_cause()[LeakCause.DOUBLE_FREE] == 1, rec.findings


def test_findings_are_grouped_per_request_with_an_exact_count_and_capped_ids() -> None:
    n = MAX_BLOCK_IDS_PER_FINDING + 8
    ledger = live(rid=A, blocks=range(1, n + 1))
    ledger.on_request_finished(A, FinishReason.ABORTED, NOW - 1)
    ledger.on_request_freed(A, NOW - 1)
    rec = audit(snap([1] * n), ledger)
    assert len(rec.findings) == 1
    f = rec.findings[0]
    assert f.blocks == n
    assert len(f.block_ids) == MAX_BLOCK_IDS_PER_FINDING


def test_a_shared_leaked_block_is_charged_to_every_finished_holder() -> None:
    ledger = live(rid=A, blocks=(1,))
    ledger.on_request_admitted(B, NOW - 9)
    ledger.on_blocks_acquired(B, [1], AcquireKind.PREFIX_HIT)
    for rid in (A, B):
        ledger.on_request_finished(rid, FinishReason.ABORTED, NOW - 2)
        ledger.on_request_freed(rid, NOW - 2)
    rec = audit(snap([2]), ledger)
    assert rec.states[BlockState.HELD_BY_FINISHED] == 1
    assert {(f.request_id, f.blocks) for f in rec.findings} == {(A, 1), (B, 1)}
    assert rec.finished_requests_holding == 2


def test_findings_carry_the_evidence_kind_of_the_audit() -> None:
    rec = audit(snap([1]), vllm_ledger(), evidence=Evidence.ONLINE)
    assert [f.evidence for f in rec.findings] == [Evidence.ONLINE]


def test_reconcile_changes_neither_the_ledger_nor_the_snapshot() -> None:
    ledger = live(rid=A, blocks=(1, 2))
    ledger.on_request_finished(A, FinishReason.ABORTED, NOW - 1)
    ledger.on_request_freed(A, NOW - 1)
    s = snap([1, 1, 0])
    before = (ledger.num_records, ledger.num_ownerships, dict(ledger.record(A).blocks),
              list(s.ref_counts), ledger.num_double_frees)
    first = rows(audit(s, ledger))
    second = rows(audit(s, ledger))
    assert first == second
    assert before == (ledger.num_records, ledger.num_ownerships, dict(ledger.record(A).blocks),
                      list(s.ref_counts), ledger.num_double_frees)


def test_a_snapshot_with_arrays_of_different_lengths_is_rejected() -> None:
    with pytest.raises(CorruptStateError):
        PoolSnapshot(ref_counts=[0, 0, 0], cached=[False, False], num_free_reported=2)
    with pytest.raises(CorruptStateError):
        PoolSnapshot(ref_counts=[0, 0], cached=[False, False], num_free_reported=1,
                     in_free_queue=[False])


# ---------------------------------------------------------------- verdicts
@pytest.mark.parametrize(
    ("capacity", "cached", "threshold", "verdict"),
    [
        (10, 8, 0.8, Verdict.SATURATED),  # exactly at the threshold
        (10, 7, 0.8, Verdict.CLEAN),
        (10, 10, 0.8, Verdict.SATURATED),
        (10, 0, 0.8, Verdict.CLEAN),
        (10, 5, 0.5, Verdict.SATURATED),
        (10, 4, 0.5, Verdict.CLEAN),
    ],
)
def test_a_clean_pool_is_saturated_iff_cached_share_reaches_the_threshold(
    capacity: int, cached: int, threshold: float, verdict: Verdict
) -> None:
    rec = audit(snap([0] * capacity, cached=set(range(1, cached + 1))), vllm_ledger())
    got, explanation = decide(rec, saturation_ratio=threshold)
    assert got is verdict
    if verdict is Verdict.SATURATED:
        assert "not a leak" in explanation
    else:
        assert "clean" in explanation


def test_a_saturated_pool_with_a_leak_is_a_leak() -> None:
    ledger = live(rid=A, blocks=(1,))
    ledger.on_request_finished(A, FinishReason.ABORTED, NOW - 1)
    ledger.on_request_freed(A, NOW - 1)
    rec = audit(snap([1] + [0] * 9, cached=set(range(2, 11))), ledger)
    assert decide(rec)[0] is Verdict.LEAK
