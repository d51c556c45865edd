"""The reconciler's fast path states exactly what judging every block one by one states.

``reconcile`` has two walks: block by block when the free queue was read, and a fast
path (C-level gathers over the ledger's clean blocks, orphans searched only when the
counts say some exist) when it was not. The ground truth here is the per-block walk
over the same pool with every zero-ref block in the free queue, which is what the fast
path assumes: random pools (ref counts -1..3, cached or not) against random ledgers
(shared blocks, a request holding a block twice, unattributed references, double
frees, finished holders, blocks the pool does not have) must give the same states and
the same findings, block ids included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.core.findings import Finding, Reconciliation
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.snapshot import PoolSnapshot
from kvguard.core.types import AcquireKind, FinishReason, RequestId

OPS = st.lists(st.tuples(
    st.sampled_from(["acquire", "unattributed", "release", "release_any", "finish", "free"]),
    st.integers(0, 5),  # request
    st.lists(st.integers(0, 40), min_size=1, max_size=6),  # blocks (some past the pool)
), max_size=30)


def _ledger(ops: list[tuple[str, int, list[int]]]) -> OwnershipLedger:
    ledger = OwnershipLedger(null_block_ids=(0,))
    for op, r, blocks in ops:
        rid = RequestId(f"req-{r}")
        if op == "acquire":
            if ledger.record(rid) is None:
                ledger.on_request_admitted(rid, 0.0)
            ledger.on_blocks_acquired(rid, blocks, AcquireKind.ALLOCATE)
        elif op == "unattributed":
            ledger.on_blocks_acquired(None, blocks, AcquireKind.PREFIX_HIT)
        elif op == "release":
            ledger.on_blocks_released(rid, blocks)
        elif op == "release_any":
            ledger.on_blocks_released(None, blocks)
        elif op == "finish" and ledger.record(rid) is not None:
            ledger.on_request_finished(rid, FinishReason.ABORTED, 1.0)
        elif op == "free" and ledger.record(rid) is not None:
            ledger.on_request_freed(rid, 1.0)
    return ledger


def _said(rec: Reconciliation) -> list[tuple[object, ...]]:
    def one(f: Finding) -> tuple[object, ...]:
        return (f.cause, f.path, f.request_id, f.blocks, tuple(f.block_ids),
                tuple(sorted(f.all_block_ids)), f.detail)
    return sorted(map(one, rec.findings), key=repr)


def _assert_fast_path_equals_walk(refs: list[int], cached: list[bool],
                                  ledger: OwnershipLedger) -> None:
    n_zero = sum(1 for b, rc in enumerate(refs) if rc == 0 and b != 0)
    n_negative = sum(1 for b, rc in enumerate(refs) if rc < 0 and b != 0)
    num_free = n_zero + n_negative  # as vLLM counts: negative blocks sit in the free queue
    opts = ReconcileOptions(now=10.0)
    fast = reconcile(PoolSnapshot(refs, cached, num_free), ledger, opts)
    walked = reconcile(PoolSnapshot(refs, cached, num_free,
                                    in_free_queue=[rc <= 0 for rc in refs]), ledger, opts)
    assert fast.states == walked.states
    assert _said(fast) == _said(walked)
    assert fast.num_free_observed == walked.num_free_observed
    assert fast.finished_requests_holding == walked.finished_requests_holding
    # The reader may count the evictable blocks itself and read ``cached`` per block
    # (vLLM's reader: no list of hashes): the same states and findings.
    lazy = _CountingColumn(cached)
    cached_unreferenced = sum(1 for rc, c in zip(refs, cached, strict=True) if rc == 0 and c)
    counted = reconcile(PoolSnapshot(refs, lazy, num_free,
                                     cached_unreferenced=cached_unreferenced), ledger, opts)
    assert counted.states == walked.states
    assert _said(counted) == _said(walked)


class _CountingColumn(Sequence[bool]):
    """A ``cached`` column that counts how many entries were read."""

    def __init__(self, values: list[bool]) -> None:
        self.values = values
        self.reads = 0

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, i: int) -> bool: ...
    @overload
    def __getitem__(self, i: slice) -> list[bool]: ...
    def __getitem__(self, i: int | slice) -> bool | list[bool]:
        if isinstance(i, slice):
            raise AssertionError("the audit sliced the cached column")
        self.reads += 1
        return self.values[i]


@settings(max_examples=300, deadline=None)
@given(
    pool=st.lists(st.tuples(st.integers(-1, 3), st.booleans()), min_size=2, max_size=36),
    ops=OPS,
)
def test_fast_path_equals_the_block_by_block_walk(
    pool: list[tuple[int, bool]], ops: list[tuple[str, int, list[int]]]
) -> None:
    ledger = _ledger(ops)
    # The ledger's index of shared blocks is exactly its blocks with more than one reference.
    assert ledger.shared_block_ids() == {
        b for b, o in ledger.owners_map().items() if isinstance(o, dict)}
    refs = [rc for rc, _ in pool]
    cached = [c for _, c in pool]
    _assert_fast_path_equals_walk(refs, cached, ledger)


@settings(max_examples=300, deadline=None)
@given(
    ops=OPS,
    cached=st.lists(st.booleans(), min_size=41, max_size=41),
    drift=st.lists(st.tuples(st.integers(0, 40), st.integers(-1, 3)), max_size=2),
)
def test_fast_path_equals_the_walk_on_pools_that_mostly_agree_with_the_ledger(
    ops: list[tuple[str, int, list[int]]], cached: list[bool],
    drift: list[tuple[int, int]],
) -> None:
    """Random pools rarely have every owned block at ref 1, so the fast path's all-clean
    branch needs pools built from the ledger: each block's ref count is the references
    the ledger holds on it, then at most two blocks drift."""
    ledger = _ledger(ops)
    refs = [0] * 41
    for b, o in ledger.owners_map().items():
        if b < 41:
            refs[b] += sum(o.values()) if isinstance(o, dict) else 1
    for b, n in ledger.unattributed_map().items():
        if b < 41:
            refs[b] += n
    for b, rc in drift:
        refs[b] = rc
    refs[0] = 0
    _assert_fast_path_equals_walk(refs, cached, ledger)


def test_a_busy_pool_of_clean_blocks_takes_no_finding() -> None:
    """The common case, stated: live single owners with ref 1, cached or not, are active."""
    ledger = OwnershipLedger(null_block_ids=(0,))
    for r in range(4):
        rid = RequestId(f"req-{r}")
        ledger.on_request_admitted(rid, 0.0)
        ledger.on_blocks_acquired(rid, range(1 + 4 * r, 5 + 4 * r), AcquireKind.ALLOCATE)
    refs = [0] + [1] * 16 + [0] * 8
    cached = [False] + [b % 2 == 0 for b in range(16)] + [True] * 3 + [False] * 5
    rec = reconcile(PoolSnapshot(refs, cached, 8), ledger, ReconcileOptions(now=1.0))
    assert rec.findings == []
    assert (rec.states.active, rec.states.cached, rec.states.free) == (16, 3, 5)


def test_a_counted_pool_reads_only_the_blocks_it_judges_one_by_one() -> None:
    """With the evictable blocks counted by the reader, the audit of a busy pool reads the
    cached column only for the blocks it judges one by one (here the finished holder's),
    not for the clean blocks or the free ones."""
    ledger = OwnershipLedger(null_block_ids=(0,))
    for r in range(4):
        rid = RequestId(f"req-{r}")
        ledger.on_request_admitted(rid, 0.0)
        ledger.on_blocks_acquired(rid, range(1 + 4 * r, 5 + 4 * r), AcquireKind.ALLOCATE)
    ledger.on_request_finished(RequestId("req-3"), FinishReason.ABORTED, 1.0)
    ledger.on_request_freed(RequestId("req-3"), 1.0)  # still holds blocks 13-16
    refs = [0] + [1] * 16 + [0] * 8
    cached = _CountingColumn([False] + [b % 2 == 0 for b in range(16)] + [True] * 3
                             + [False] * 5)
    rec = reconcile(PoolSnapshot(refs, cached, 8, cached_unreferenced=3), ledger,
                    ReconcileOptions(now=100.0))
    assert (rec.states.active, rec.states.cached, rec.states.free) == (12, 3, 5)
    assert [f.block_ids for f in rec.findings] == [[13, 14, 15, 16]]
    assert cached.reads <= 4 + 1  # the four held blocks, and at most the null block


def test_an_unowned_reference_is_found_without_the_free_queue() -> None:
    """An orphan is a non-zero ref count nobody owns: the counts must send the audit to it."""
    ledger = OwnershipLedger(null_block_ids=(0,))
    rid = RequestId("req-0")
    ledger.on_request_admitted(rid, 0.0)
    ledger.on_blocks_acquired(rid, [1, 2], AcquireKind.ALLOCATE)
    refs = [0, 1, 1, 0, 1, 0]  # block 4: referenced, owned by nobody
    rec = reconcile(PoolSnapshot(refs, [False] * 6, 2), ledger, ReconcileOptions(now=1.0))
    assert [(f.cause.value, f.block_ids) for f in rec.findings] == [("orphan", [4])]
