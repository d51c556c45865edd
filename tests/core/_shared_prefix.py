"""A pool where four aborted requests that shared a prefix all keep it, and one block is orphaned.

Ground truth for distinct leaked-block counts (issue 13.1): the pool lost 2 shared
+ 4 private + 1 orphaned = 7 blocks, while the findings' own counts sum to 13.
"""

from __future__ import annotations

from kvguard.core.checkpoint import build_report
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.report import CheckpointReport
from kvguard.core.snapshot import PoolSnapshot
from kvguard.core.types import AcquireKind, FinishReason, RequestId

NOW = 1_000.0
SHARED = [1, 2]  # the common prefix, one reference per holder
REQS = {RequestId(f"r{i}-0000000{i}"): [3 + i] for i in range(4)}  # one private block each
ORPHAN_BLOCK = 9
N_BLOCKS = 16


def leaky_pool() -> tuple[PoolSnapshot, OwnershipLedger]:
    ledger = OwnershipLedger()
    refs = [0] * N_BLOCKS
    for rid, private in REQS.items():
        ledger.on_request_admitted(rid, NOW - 20)
        ledger.on_blocks_acquired(rid, SHARED, AcquireKind.PREFIX_HIT)
        ledger.on_blocks_acquired(rid, private, AcquireKind.ALLOCATE)
        ledger.on_request_finished(rid, FinishReason.ABORTED, NOW - 10)
        ledger.on_request_freed(rid, NOW - 10)  # declared freed; the pool never saw it
        for b in [*SHARED, *private]:
            refs[b] += 1
    refs[ORPHAN_BLOCK] = 1  # a reference nobody owns
    free = [b for b in range(1, N_BLOCKS) if refs[b] == 0]
    snap = PoolSnapshot(ref_counts=refs, cached=[b in SHARED for b in range(N_BLOCKS)],
                        num_free_reported=len(free),
                        in_free_queue=[b in free for b in range(N_BLOCKS)],
                        null_block_ids=frozenset({0}))
    return snap, ledger


def leaky_report(checkpoint_id: int = 1, *, engine: str = "dp0", epoch: str = "e1",
                 taken_at: float = NOW) -> CheckpointReport:
    """The drained checkpoint report of ``leaky_pool``, from the real reconciler."""
    snap, ledger = leaky_pool()
    rec = reconcile(snap, ledger, ReconcileOptions(now=NOW))
    return build_report(rec, checkpoint_id=checkpoint_id, engine=engine, epoch=epoch,
                        taken_at=taken_at, saturation_ratio=0.8)


def truth() -> int:
    """Blocks the pool really lost: every block with a reference (the engine is idle)."""
    snap, _ = leaky_pool()
    return sum(1 for b, rc in enumerate(snap.ref_counts) if b not in snap.null_block_ids and rc)
