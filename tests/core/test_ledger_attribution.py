"""Releases without a request id must come off the request that is really freeing.

A pool-level ``free_blocks`` hook has no request at hand. When the block is
shared (a prefix hit), the ledger must guess which owner lets go. These tests
pin the guesses that keep findings true, straight against the ledger API with
the minimal event sequence a vLLM hook would produce; the reference pool's ref
counts are written out by hand in the snapshot.
"""

from __future__ import annotations

from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.snapshot import PoolSnapshot
from kvguard.core.types import (
    AcquireKind,
    FinishReason,
    LeakCause,
    LeakPath,
    RequestId,
)

A = RequestId("a-0000000a")
B = RequestId("b-0000000b")


def _snapshot(ref_counts: list[int], cached: set[int] | None = None) -> PoolSnapshot:
    cached = cached if cached is not None else set(range(len(ref_counts)))
    return PoolSnapshot(
        ref_counts=ref_counts,
        cached=[b in cached and b != 0 for b in range(len(ref_counts))],
        num_free_reported=sum(1 for b, rc in enumerate(ref_counts) if b and rc == 0),
    )


def _findings(ledger: OwnershipLedger, refs: list[int], now: float = 10.0):
    rec = reconcile(_snapshot(refs), ledger, ReconcileOptions(now=now))
    return [(f.cause, f.request_id, f.blocks, f.path) for f in rec.findings]


def test_a_prefix_sharers_pool_level_free_does_not_erase_an_aborted_requests_leak() -> None:
    """Abort leaks block 1 (free skipped); B prefix-hits it and finishes normally.

    The pool-level release of B's reference must come off B: A's leaked
    reference stays A's, and the finding names A, aborted, on the abort path.
    """
    ledger = OwnershipLedger()
    ledger.on_request_admitted(A, 0.0)
    ledger.on_blocks_acquired(None, [1], AcquireKind.ALLOCATE)  # pool ref 1
    ledger.claim(A, [1])
    ledger.on_request_finished(A, FinishReason.ABORTED, 1.0)
    ledger.on_request_freed(A, 1.0)  # FAULT: the free was skipped, pool ref stays 1

    ledger.on_request_admitted(B, 2.0)
    ledger.on_blocks_acquired(None, [1], AcquireKind.PREFIX_HIT)  # pool ref 2
    ledger.claim(B, [1])
    ledger.on_request_finished(B, FinishReason.STOPPED, 3.0)
    ledger.on_blocks_released(None, [1])  # B's free: pool ref 1
    ledger.on_request_freed(B, 3.0)

    assert _findings(ledger, [0, 1, 0, 0]) == [
        (LeakCause.FINISHED_REQUEST, A, 1, LeakPath.ABORT)
    ]


def test_a_pool_level_preemption_of_a_prefix_sharer_leaves_a_healthy_pool_clean() -> None:
    """A allocates block 1, B prefix-hits it, B is preempted, A grows, all finish.

    Nothing leaks: every audit, mid-flight and drained, must be free of findings,
    and the ledger must forget both requests.
    """
    ledger = OwnershipLedger()
    ledger.on_request_admitted(A, 0.0)
    ledger.on_blocks_acquired(None, [1], AcquireKind.ALLOCATE)  # pool: 1 -> ref 1
    ledger.claim(A, [1])
    ledger.on_request_admitted(B, 1.0)
    ledger.on_blocks_acquired(None, [1], AcquireKind.PREFIX_HIT)  # pool: 1 -> ref 2
    ledger.claim(B, [1])
    ledger.on_request_preempted(B)
    ledger.on_blocks_released(None, [1])  # B's free on preemption: 1 -> ref 1
    ledger.on_blocks_acquired(None, [2], AcquireKind.ALLOCATE)  # A grows: 2 -> ref 1
    ledger.claim(A, [1, 2])  # A's block table from the engine
    assert _findings(ledger, [0, 1, 1, 0]) == [], "mid-flight audit of a healthy pool"

    ledger.on_request_finished(A, FinishReason.STOPPED, 4.0)
    ledger.on_blocks_released(None, [1, 2])  # pool: all ref 0
    ledger.on_request_freed(A, 4.0)
    ledger.on_request_finished(B, FinishReason.ABORTED, 5.0)  # B aborted while waiting
    ledger.on_request_freed(B, 5.0)

    assert _findings(ledger, [0, 0, 0, 0]) == [], "drained audit of a healthy pool"
    assert ledger.num_records == 0
    assert sum(ledger.num_finished_compacted.values()) == 2


def test_mixed_hook_styles_do_not_turn_a_preemption_into_a_double_free() -> None:
    """B's preemption is seen by a pool-level hook, A's later free by an attributed one."""
    ledger = OwnershipLedger()
    ledger.on_request_admitted(A, 0.0)
    ledger.on_blocks_acquired(None, [1], AcquireKind.ALLOCATE)
    ledger.claim(A, [1])
    ledger.on_request_admitted(B, 1.0)
    ledger.on_blocks_acquired(None, [1], AcquireKind.PREFIX_HIT)
    ledger.claim(B, [1])
    ledger.on_request_preempted(B)
    ledger.on_blocks_released(None, [1])  # B's free: pool ref 1
    ledger.on_request_preempted(A)
    ledger.on_blocks_released(A, [1])  # A's free, attributed: pool ref 0

    assert ledger.num_double_frees == 0
    assert _findings(ledger, [0, 0, 0, 0]) == []


def test_attributed_releases_of_a_shared_block_come_off_the_named_request() -> None:
    ledger = OwnershipLedger()
    ledger.on_request_admitted(A, 0.0)
    ledger.on_blocks_acquired(A, [1], AcquireKind.ALLOCATE)
    ledger.on_request_admitted(B, 1.0)
    ledger.on_blocks_acquired(B, [1], AcquireKind.PREFIX_HIT)
    ledger.on_request_preempted(B)
    ledger.on_blocks_released(B, [1])
    assert dict(ledger.owners_of(1)) == {A: 1}
    assert ledger.record(B).blocks == {}


def test_a_pool_level_release_prefers_the_finishing_request_over_a_live_sharer() -> None:
    ledger = OwnershipLedger()
    ledger.on_request_admitted(A, 0.0)
    ledger.on_blocks_acquired(None, [1], AcquireKind.ALLOCATE)
    ledger.claim(A, [1])
    ledger.on_request_admitted(B, 1.0)
    ledger.on_blocks_acquired(None, [1], AcquireKind.PREFIX_HIT)
    ledger.claim(B, [1])
    ledger.on_request_finished(B, FinishReason.LENGTH, 2.0)
    ledger.on_blocks_released(None, [1])
    ledger.on_request_freed(B, 2.0)
    assert dict(ledger.owners_of(1)) == {A: 1}
    assert ledger.record(B) is None  # compacted
    assert _findings(ledger, [0, 1]) == []


def test_claim_takes_an_unattributed_reference_instead_of_adding_one() -> None:
    ledger = OwnershipLedger()
    ledger.on_request_admitted(A, 0.0)
    ledger.on_blocks_acquired(None, [3, 4], AcquireKind.ALLOCATE)
    assert ledger.unattributed_refs(3) == 1
    ledger.claim(A, [3, 4])
    ledger.claim(A, [3, 4])  # idempotent: the engine's table is claimed every step
    assert ledger.unattributed_refs(3) == 0
    assert ledger.record(A).blocks == {3: 1, 4: 1}
    assert dict(ledger.owners_of(4)) == {A: 1}


def test_claim_never_drops_a_block_the_engine_forgot() -> None:
    ledger = OwnershipLedger()
    ledger.on_request_admitted(A, 0.0)
    ledger.on_blocks_acquired(A, [1, 2], AcquireKind.ALLOCATE)
    ledger.claim(A, [2])  # the engine's table lost block 1 without freeing it
    assert ledger.record(A).blocks == {1: 1, 2: 1}


def test_the_null_block_is_never_recorded() -> None:
    ledger = OwnershipLedger()
    ledger.on_request_admitted(A, 0.0)
    ledger.on_blocks_acquired(A, [0, 1], AcquireKind.ALLOCATE)
    ledger.on_blocks_acquired(None, [0], AcquireKind.PREFIX_HIT)
    ledger.claim(A, [0, 1])
    ledger.on_blocks_released(A, [0])
    assert ledger.record(A).blocks == {1: 1}
    assert ledger.unattributed_refs(0) == 0
    assert ledger.num_double_frees == 0
    assert 0 not in set(ledger.owned_block_ids())


def test_claiming_blocks_marks_a_preempted_request_running_again() -> None:
    """A pool-level re-allocation after preemption is claimed: the request runs again.

    ``on_blocks_acquired(rid, ...)`` moves a waiting/preempted request to
    running; the pool-level equivalent (``on_blocks_acquired(None, ...)`` then
    ``claim``) must report the same phase.
    """
    attributed, pool_level = OwnershipLedger(), OwnershipLedger()
    for ledger in (attributed, pool_level):
        ledger.on_request_admitted(A, 0.0)
    attributed.on_blocks_acquired(A, [1], AcquireKind.ALLOCATE)
    pool_level.on_blocks_acquired(None, [1], AcquireKind.ALLOCATE)
    pool_level.claim(A, [1])
    for ledger in (attributed, pool_level):
        ledger.on_request_preempted(A)
        ledger.on_blocks_released(None, [1])
    attributed.on_blocks_acquired(A, [2], AcquireKind.ALLOCATE)
    pool_level.on_blocks_acquired(None, [2], AcquireKind.ALLOCATE)
    pool_level.claim(A, [2])

    assert attributed.record(A).phase.value == "running"
    assert pool_level.record(A).phase is attributed.record(A).phase
    assert pool_level.record(A).num_preemptions == 1
