"""Joining the worker ranks' reports (:mod:`kvguard.core.worker_reports`), on fake reports.

Ground truth is the script: which rank said what, in which step. What vLLM's real NIXL
worker sends through the real channel is tested on two servers in ``tests/pd``.
"""

from __future__ import annotations

from kvguard.core.transfers import TransferEventKind, TransferOutcome
from kvguard.core.worker_reports import LateRead, LeaseLapse, RankJoin, RankReport

TP2 = 2


def _rep(rank: int, world: int = TP2, **kw: object) -> RankReport:
    return RankReport(rank=rank, world_size=world, pid=100 + rank, **kw)  # type: ignore[arg-type]


def test_a_hold_ends_only_when_every_rank_has_let_go() -> None:
    join = RankJoin()
    lapse = LeaseLapse("p-1", reads=0, expected_reads=1, at=50.0)
    assert join.feed([_rep(0, lapses=(lapse,), finished_sending=("p-1",))]) == []
    (ended,) = join.feed([_rep(1, lapses=(LeaseLapse("p-1", 0, 1, 51.0),),
                               finished_sending=("p-1",))])
    assert ended.kind is TransferEventKind.ENDED and ended.request_id == "p-1"
    assert ended.outcome is TransferOutcome.EXPIRED_UNREAD and ended.at == 51.0


def test_a_lapse_on_one_rank_makes_the_hold_expired_though_the_other_was_read() -> None:
    join = RankJoin()
    events = join.feed([
        _rep(0, finished_sending=("p-1",)),  # read on rank 0
        _rep(1, lapses=(LeaseLapse("p-1", 0, 1, 60.0),), finished_sending=("p-1",)),
    ])
    assert [(e.kind, e.outcome) for e in events] == [
        (TransferEventKind.ENDED, TransferOutcome.EXPIRED_UNREAD)]


def test_a_hold_read_on_every_rank_leaves_the_outcome_to_vllms_finished_sending() -> None:
    join = RankJoin()
    assert join.feed([_rep(0, finished_sending=("p-1",)),
                      _rep(1, finished_sending=("p-1",))]) == []
    assert sum(c.finished_sending_total for c in join.ranks.values()) == 2


def test_a_late_read_waits_for_the_hold_to_end_then_is_reported() -> None:
    join = RankJoin()
    join.feed([_rep(0, lapses=(LeaseLapse("p-1", 0, 1, 50.0),), finished_sending=("p-1",),
                    late_reads=(LateRead("p-1", 52.0),))])
    events = join.feed([_rep(1, lapses=(LeaseLapse("p-1", 0, 1, 50.5),),
                             finished_sending=("p-1",))])
    assert [e.kind for e in events] == [TransferEventKind.ENDED, TransferEventKind.LATE_READ]
    (late,) = join.feed([_rep(1, late_reads=(LateRead("p-1", 53.0),))])
    assert late.kind is TransferEventKind.LATE_READ and late.at == 53.0


def test_a_late_read_of_a_request_no_rank_saw_lapse_is_not_reported() -> None:
    join = RankJoin()
    join.feed([_rep(0, world=1, finished_sending=("p-1",))])
    assert join.feed([_rep(0, world=1, late_reads=(LateRead("p-1", 9.0),))]) == []


def test_partly_read_when_a_lapsed_rank_had_fewer_reads_than_readers() -> None:
    join = RankJoin()
    (ended,) = join.feed([_rep(0, world=1, lapses=(LeaseLapse("p-1", 1, 2, 5.0),),
                               finished_sending=("p-1",))])
    assert ended.outcome is TransferOutcome.EXPIRED_PARTLY_READ and ended.reads == 1


def test_deadlines_are_the_latest_over_the_ranks_that_still_hold() -> None:
    join = RankJoin()
    assert not join.reporting and join.deadlines() == {}
    join.feed([_rep(0, deadlines={"p-1": 100.0, "p-2": 90.0}),
               _rep(1, deadlines={"p-1": 104.0})])
    assert join.reporting and join.deadlines() == {"p-1": 104.0, "p-2": 90.0}
    join.feed([_rep(1, finished_sending=("p-1",))])  # rank 1 let go: rank 0 still holds
    assert join.deadlines() == {"p-1": 100.0, "p-2": 90.0}
    join.feed([_rep(0, deadlines={"p-2": 95.0}, finished_sending=("p-1",))])  # renewed
    assert join.deadlines() == {"p-2": 95.0}


def test_counters_are_per_rank_and_a_restarted_worker_starts_over() -> None:
    join = RankJoin()
    join.feed([_rep(0, world=1, lapses_total=3, late_reads_total=2, dropped_total=1,
                    errors_total=4, finished_recving=("d-1", "d-2"))])
    (c,) = join.ranks.values()
    assert (c.lapses_total, c.late_reads_total, c.dropped_total, c.errors_total,
            c.finished_recving_total, c.reports_total) == (3, 2, 1, 4, 2, 1)
    join.feed([RankReport(rank=0, world_size=1, pid=999, lapses_total=1)])
    (c,) = join.ranks.values()
    assert (c.pid, c.reports_total, c.lapses_total, c.finished_recving_total) == (999, 1, 1, 0)
