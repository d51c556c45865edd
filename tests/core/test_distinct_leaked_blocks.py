"""Leaked blocks are counted once each, however many findings name them (issue 13.1).

Four finished requests that shared a prefix through the prefix cache all still
hold its blocks, and one block is orphaned. The pool lost the *distinct* blocks:
every "leaked blocks" figure (report total, per cause, metric, CLI, trend,
explanation) must say that number and equal the pool states, while each
finding keeps its own count and says how many of its blocks it shares.
"""

from __future__ import annotations

from _shared_prefix import NOW, ORPHAN_BLOCK, REQS, leaky_pool
from _shared_prefix import leaky_report as _report
from _shared_prefix import truth as _truth

from kvguard.cli.render import render_report
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.snapshot import PoolSnapshot
from kvguard.core.trend import trend
from kvguard.core.types import LeakCause


def test_report_counts_each_leaked_block_once_and_equals_the_pool_states() -> None:
    r = _report()
    assert _truth() == 2 + 4 + 1
    assert r.leaked_blocks == _truth()
    assert r.leaked_blocks_by_cause[LeakCause.FINISHED_REQUEST] == 2 + 4
    assert r.leaked_blocks_by_cause[LeakCause.ORPHAN] == 1
    assert sum(r.leaked_blocks_by_cause.values()) == r.leaked_blocks
    assert r.pool is not None
    assert r.leaked_blocks == r.pool.held_by_finished + r.pool.orphaned
    # Each finding keeps its own count and says how much of it is shared.
    per_request = {lk.request_id: lk for lk in r.leaks if lk.cause is LeakCause.FINISHED_REQUEST}
    assert set(per_request) == set(REQS)
    for lk in per_request.values():
        assert (lk.blocks, lk.shared_blocks) == (3, 2)
    orphan = next(lk for lk in r.leaks if lk.cause is LeakCause.ORPHAN)
    assert (orphan.blocks, orphan.shared_blocks, orphan.block_ids) == (1, 0, [ORPHAN_BLOCK])
    # The sum over findings is what used to be reported: it over-counts.
    assert sum(lk.blocks for lk in r.leaks) == 13 != r.leaked_blocks


def test_explanation_and_cli_say_the_distinct_count() -> None:
    r = _report()
    assert r.explanation.startswith("7 block(s) leaked in 5 finding(s).")
    assert "still holds 3 block(s) (2 shared with another finding)" in r.explanation
    text = render_report(r)
    assert "leaks: 7 distinct block(s)" in text
    assert "13" not in text.replace("1000", "")


def test_trend_uses_distinct_counts() -> None:
    reports = [_report(i) for i in (1, 2)]
    t = trend(reports)
    assert "7 leaked blocks at the last drained checkpoint" in t.explanation


def test_a_pool_level_count_without_ids_still_counts() -> None:
    # Without a free-queue walk, a free count the ref counts cannot explain is a
    # pool-level finding with a count and no ids: it adds to the distinct total.
    snap, ledger = leaky_pool()
    snap2 = PoolSnapshot(ref_counts=snap.ref_counts, cached=snap.cached,
                         num_free_reported=snap.num_free_reported + 2, in_free_queue=None,
                         null_block_ids=snap.null_block_ids)
    rec = reconcile(snap2, ledger, ReconcileOptions(now=NOW))
    assert rec.leaked_blocks_by_cause()[LeakCause.DOUBLE_FREE] == 2
    assert rec.leaked_blocks() == _truth() + 2
