"""Each injected fault is found at the next drained checkpoint, with the right cause.

Every test runs a random healthy workload on the reference pool, injects one
fault, lets more traffic run (including traffic that reuses the faulty
blocks through the prefix cache), drains, and audits. The hooks feed the
ledger in one of three styles: attributed, pool-level, or mixed.
"""

from __future__ import annotations

import pytest
from _pool import Harness, random_clean_ops
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvguard.core.ledger import DOUBLE_FREE_HISTORY, OwnershipLedger
from kvguard.core.types import (
    BlockState,
    Evidence,
    FinishReason,
    LeakCause,
    LeakPath,
    Verdict,
)
from kvguard.core.verdict import decide, describe_finding

STYLES = ["attributed", "pool", "mixed"]
NO_EXPLAIN = tuple(p for p in Phase if p is not Phase.explain)
"""The explain phase costs minutes on a failure; the shrunk example is enough."""
FAST = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    report_multiple_bugs=False,
    phases=NO_EXPLAIN,
)


def _attributed(style: str, data: st.DataObject) -> bool:
    if style == "mixed":
        return data.draw(st.booleans(), label="attributed")
    return style == "attributed"


def _request_with_blocks(h: Harness, data: st.DataObject, style: str):
    """A fresh live request holding >= 1 block, some possibly shared via a prefix hit."""
    if h.pool.num_free == 0:
        h.drain(attributed=_attributed(style, data))
    req = h.admit()
    cands = h.hashed_candidates(req)
    if cands and data.draw(st.booleans(), label="starts with a prefix hit"):
        hit = data.draw(st.lists(st.sampled_from(cands), min_size=1, max_size=3, unique=True))
        h.prefix_hit(req, hit, attributed=_attributed(style, data))
    if h.pool.num_free:
        n = data.draw(st.integers(1, min(6, h.pool.num_free)), label="k")
        mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="hashed")
        h.allocate(req, n, hash_mask=mask, attributed=_attributed(style, data))
    return req


def _reuse_prefix(h: Harness, blocks: list[int], data: st.DataObject, style: str) -> None:
    """A later request with the same prompt prefix hits cached blocks, then finishes."""
    sharer = h.admit()
    hit = sorted(b for b in blocks if b in h.pool.hashed)
    if hit:
        h.prefix_hit(sharer, hit, attributed=_attributed(style, data))
    h.finish(sharer, FinishReason.STOPPED, attributed=_attributed(style, data))


def _assert_pool_accounting(h: Harness, rec) -> None:
    assert rec.states.total == h.pool.capacity
    assert rec.num_free_reported == h.pool.num_free


# ------------------------------------------------------------- skipped free
@pytest.mark.parametrize("style", STYLES)
@FAST
@given(num_blocks=st.integers(9, 65), data=st.data())
def test_a_skipped_free_on_abort_is_found_naming_the_request_path_and_block_count(
    style: str, num_blocks: int, data: st.DataObject
) -> None:
    h = Harness(num_blocks)
    random_clean_ops(h, data, data.draw(st.integers(0, 25), label="ops before"), style=style)
    victim = _request_with_blocks(h, data, style)
    k = len(victim.blocks)
    declare_freed = data.draw(st.booleans(), label="engine declares it freed")
    leak = h.skip_free_on_abort(victim, declare_freed=declare_freed)
    _reuse_prefix(h, leak.blocks, data, style)
    random_clean_ops(h, data, data.draw(st.integers(0, 25), label="ops after"), style=style)
    h.drain(attributed=_attributed(style, data))

    rec = h.reconcile(walk_free_queue=data.draw(st.booleans(), label="walk free queue"))

    _assert_pool_accounting(h, rec)
    assert rec.num_free_observed == h.pool.num_free
    # Every leaked block is out of circulation and the checkpoint says leak.
    assert rec.states[BlockState.HELD_BY_FINISHED] + rec.states[BlockState.ORPHANED] == k
    assert decide(rec)[0] is Verdict.LEAK
    if not declare_freed and style != "attributed":
        # The engine never said it was done with the victim, so to pool-level
        # hooks it looks like a request whose free is still coming: a later
        # sharer's release may be charged to it. Only the above is guaranteed.
        return
    assert rec.states[BlockState.HELD_BY_FINISHED] == k
    assert rec.leaked_blocks_by_cause()[LeakCause.FINISHED_REQUEST] == k
    assert {f.cause for f in rec.findings} == {LeakCause.FINISHED_REQUEST}
    assert rec.finished_requests_holding == 1
    assert len(rec.findings) == 1, rec.findings
    (f,) = rec.findings
    assert f.cause is LeakCause.FINISHED_REQUEST
    assert f.path is LeakPath.ABORT
    assert f.request_id == victim.rid
    assert f.client_request_id == victim.client_id
    assert f.finish_reason is FinishReason.ABORTED
    assert f.blocks == k
    assert sorted(f.block_ids) == sorted(leak.blocks)
    assert f.held_for_seconds == pytest.approx(h.t - leak.finished_at)
    assert f.evidence is Evidence.DRAINED

    verdict, explanation = decide(rec)
    assert verdict is Verdict.LEAK
    assert (
        f"request {victim.client_id} finished (aborted) {h.t - leak.finished_at:.1f} s ago "
        f"and still holds {k} block(s)"
    ) in explanation
    assert describe_finding(f) in explanation
    assert rec.leaked_blocks_by_cause()[LeakCause.FINISHED_REQUEST] == k
    # The leaker is the only request the ledger still remembers.
    assert [r.request_id for r in h.ledger.records()] == [victim.rid]


def test_a_leak_keeps_growing_across_checkpoints_while_saturation_does_not() -> None:
    """One aborted request leaks per round: the leaked-block count grows with every checkpoint."""
    h = Harness(33)
    leaked = []
    for _ in range(4):
        for _ in range(3):  # healthy traffic that fills the prefix cache
            r = h.admit()
            h.allocate(r, 2, hash_mask=[True, True], attributed=True)
            h.finish(r, FinishReason.STOPPED, attributed=True)
        bad = h.admit()
        h.allocate(bad, 2, hash_mask=[False, False], attributed=True)
        h.skip_free_on_abort(bad)
        rec = h.reconcile()
        leaked.append(rec.leaked_blocks_by_cause()[LeakCause.FINISHED_REQUEST])
        assert decide(rec)[0] is Verdict.LEAK
    assert leaked == [2, 4, 6, 8]


# ------------------------------------------------------------ stray reference
@pytest.mark.parametrize("style", STYLES)
@FAST
@given(num_blocks=st.integers(9, 65), data=st.data())
def test_a_reference_taken_outside_the_hooks_is_drift_while_owned_and_an_orphan_at_drain(
    style: str, num_blocks: int, data: st.DataObject
) -> None:
    h = Harness(num_blocks)
    random_clean_ops(h, data, data.draw(st.integers(0, 30), label="ops before"), style=style)
    b = data.draw(st.sampled_from(h.bump_candidates()), label="bumped block")
    live_owners = {r.rid for r in h.live() if b in r.blocks}
    h.bump_ref(b)

    online = h.reconcile(evidence=Evidence.ONLINE)
    _assert_pool_accounting(h, online)
    assert len(online.findings) == 1, online.findings
    (f,) = online.findings
    assert f.block_ids == [b] and f.blocks == 1
    assert f.evidence is Evidence.ONLINE
    if live_owners:
        assert f.cause is LeakCause.REFCOUNT_DRIFT
        assert f.request_id in live_owners
        assert online.states[BlockState.ACTIVE] == len({x for r in h.live() for x in r.blocks})
    else:
        assert f.cause is LeakCause.ORPHAN
        assert f.request_id is None
        assert online.states[BlockState.ORPHANED] == 1

    random_clean_ops(h, data, data.draw(st.integers(0, 20), label="ops after"), style=style)
    h.drain(attributed=_attributed(style, data))
    rec = h.reconcile(walk_free_queue=data.draw(st.booleans(), label="walk free queue"))
    _assert_pool_accounting(h, rec)
    assert rec.num_free_observed == h.pool.num_free
    assert [(x.cause, x.request_id, x.blocks, x.block_ids, x.path) for x in rec.findings] == [
        (LeakCause.ORPHAN, None, 1, [b], LeakPath.UNKNOWN)
    ]
    assert rec.states[BlockState.ORPHANED] == 1
    assert rec.finished_requests_holding == 0
    assert decide(rec)[0] is Verdict.LEAK
    assert h.ledger.num_records == 0


# ----------------------------------------------------------------- double free
@pytest.mark.parametrize("style", STYLES)
@FAST
@given(num_blocks=st.integers(9, 65), data=st.data())
def test_a_double_free_is_found_as_double_free(
    style: str, num_blocks: int, data: st.DataObject
) -> None:
    h = Harness(num_blocks)
    random_clean_ops(h, data, data.draw(st.integers(0, 25), label="ops before"), style=style)
    culprit = _request_with_blocks(h, data, style)
    b = data.draw(st.sampled_from(culprit.blocks), label="double-freed block")
    if b in h.pool.hashed and data.draw(st.booleans(), label="shared"):
        sharer = h.admit()
        h.prefix_hit(sharer, [b], attributed=_attributed(style, data))
    sharers = [r for r in h.live() if r is not culprit and b in r.blocks]
    attributed = _attributed(style, data)
    h.finish(culprit, FinishReason.STOPPED, attributed=attributed, double_free_block=b)

    if len(sharers) == 1 and attributed:
        # Mid-flight: the block sits in the free queue while its one sharer still uses it.
        assert h.pool.ref[b] == 0
        online = h.reconcile(evidence=Evidence.ONLINE)
        assert any(
            f.cause is LeakCause.DOUBLE_FREE and f.request_id == culprit.rid and b in f.block_ids
            for f in online.findings
        ), online.findings

    h.drain(attributed=_attributed(style, data))
    walk = data.draw(st.booleans(), label="walk free queue")
    rec = h.reconcile(walk_free_queue=walk)
    _assert_pool_accounting(h, rec)
    assert rec.num_free_observed == sum(1 for x in h.pool.ref[1:] if x == 0)
    assert rec.findings, "a double free went unnoticed"
    assert {f.cause for f in rec.findings} == {LeakCause.DOUBLE_FREE}, rec.findings
    assert any(b in f.block_ids for f in rec.findings)
    if attributed:
        assert any(f.request_id == culprit.rid and b in f.block_ids for f in rec.findings)
    verdict, explanation = decide(rec)
    assert verdict is Verdict.LEAK
    assert "urgent" in explanation


# ---------------------------------------------------------------- memory bound
@pytest.mark.parametrize("style", STYLES)
@FAST
@given(num_blocks=st.integers(9, 65), data=st.data())
def test_the_ledger_forgets_every_request_that_finished_and_freed_cleanly(
    style: str, num_blocks: int, data: st.DataObject
) -> None:
    h = Harness(num_blocks)
    random_clean_ops(h, data, data.draw(st.integers(1, 60), label="ops"), style=style)
    h.drain(attributed=_attributed(style, data))
    n = h.num_finished_clean
    assert h.ledger.num_records == 0, [r.request_id for r in h.ledger.records()]
    assert h.ledger.num_ownerships == 0
    assert not set(h.ledger.owned_block_ids())
    assert sum(h.ledger.num_finished_compacted.values()) == n
    assert dict(h.ledger.num_finished_compacted) == dict(h.finished_clean_by_reason)
    assert h.ledger.num_double_frees == 0


def test_the_double_free_history_is_bounded_and_the_count_exact() -> None:
    ledger = OwnershipLedger()
    n = DOUBLE_FREE_HISTORY + 100
    for i in range(n):
        ledger.on_blocks_released(None, [1 + i % 50])
    assert ledger.num_double_frees == n
    assert len(ledger.double_frees) == DOUBLE_FREE_HISTORY
    assert ledger.num_records == 0
