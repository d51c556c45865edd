"""The reclaim monitor's decisions, on a wedge monitor fed a real ledger (no engine).

What a user relies on: an ownership is handed to the engine's free path only after
``after_verdicts`` consecutive wedge verdicts named it, once per wedge; orphans and drift
are refused (``owner_unknown``), never handed over; a free path that raises is counted as a
hook error and a refusal, and the engine goes on; nothing at all happens while nothing is
wedged. The engine side (vLLM's real free paths) is proved in
tests/scheduler/test_reclaim_free_paths.py.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvguard.core.dead_owners import dead_owners
from kvguard.core.hook_errors import HookErrors
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.monitors.reclaim import ReclaimWatch
from kvguard.core.reclaim import ReclaimOutcome, RefusalReason
from kvguard.core.types import AcquireKind, FinishReason, LeakCause, RequestId
from kvguard.core.wedge import DeadOwner, WaitingView, WedgeOptions
from kvguard.core.wedge_monitor import JUDGE_INTERVAL_SECONDS, WedgeMonitor

CAPACITY = 15


class _Queue:
    def __init__(self, free: int) -> None:
        self.waiting = ["starved"]
        self.free = free

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return 0

    def head_request_id(self) -> str | None:
        return self.waiting[0] if self.waiting else None

    def read(self, now: float) -> WaitingView:
        return WaitingView(len(self.waiting), 0, 5.0, 6, self.free, CAPACITY)


class _Engine:
    """A reclaimer that records what it was handed and answers ``answer``."""

    def __init__(self, answer: ReclaimOutcome | Exception) -> None:
        self.answer = answer
        self.handed: list[DeadOwner] = []

    def reclaim(self, owner: DeadOwner) -> ReclaimOutcome:
        self.handed.append(owner)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _setup(answer: ReclaimOutcome | Exception, *, orphan: bool = False,
           after: int = 3) -> tuple[WedgeMonitor, ReclaimWatch, _Engine, _Queue]:
    ledger = OwnershipLedger()
    rid = RequestId("victim-1")
    ledger.on_request_admitted(rid, 1.0)
    ledger.on_blocks_acquired(rid, list(range(1, 11)), AcquireKind.ALLOCATE)
    ledger.on_request_finished(rid, FinishReason.ABORTED, 2.0)
    ledger.on_request_freed(rid, 2.0)  # a skipped free: the record keeps its 10 blocks
    confirmed = {11: [LeakCause.ORPHAN]} if orphan else {}
    q = _Queue(free=CAPACITY - 10 - len(confirmed))
    wedge = WedgeMonitor(q, lambda now: dead_owners(ledger, now=now, bound_seconds=1.0,
                                                    confirmed_causes=confirmed),
                         WedgeOptions(after_seconds=0.0, after_steps=1))
    engine = _Engine(answer)
    host = SimpleNamespace(errors=HookErrors(), engine="dp0")
    return wedge, ReclaimWatch(host, wedge, engine, after), engine, q  # type: ignore[arg-type]


def _steps(wedge: WedgeMonitor, watch: ReclaimWatch, n: int, t0: float = 0.0) -> float:
    """``n`` step ends, one judge interval apart (each one judges)."""
    t = t0
    for _ in range(n):
        t += JUDGE_INTERVAL_SECONDS
        wedge.on_step_end(100.0 + t, t)
        watch.after_drain_check(0.001)
    return t


def test_an_owner_is_handed_over_only_at_the_nth_consecutive_verdict_and_once() -> None:
    freed = ReclaimOutcome(freed_block_ids=tuple(range(1, 11)), path="KVCacheManager.free")
    wedge, watch, engine, _ = _setup(freed)
    _steps(wedge, watch, 3)  # step 1 starts the stall; verdicts at steps 2 and 3
    assert wedge.wedged and engine.handed == []
    _steps(wedge, watch, 1, 1.5)  # the third consecutive verdict
    assert [o.engine_request_id for o in engine.handed] == ["victim-1"]
    _steps(wedge, watch, 5, 2.0)  # still named (the fake freed nothing): never twice
    assert len(engine.handed) == 1
    s = watch.state()
    assert (s.reclaims_total, s.reclaimed_blocks_total, s.refused_total) == \
        (1, {"finished_request": 10}, {})
    [e] = s.recent
    assert (e.request_id, e.blocks, e.block_ids, e.reclaimed) == \
        ("victim-1", 10, list(range(1, 11)), True)


def test_a_verdict_that_is_not_wedged_resets_the_count() -> None:
    wedge, watch, engine, q = _setup(ReclaimOutcome(freed_block_ids=(1,)))
    _steps(wedge, watch, 3)
    q.waiting = []  # the starved request went away: no longer wedged
    _steps(wedge, watch, 1, 1.5)
    q.waiting = ["starved-2"]
    _steps(wedge, watch, 3, 2.0)  # two verdicts of a new wedge: not yet
    assert engine.handed == []
    _steps(wedge, watch, 1, 3.5)
    assert len(engine.handed) == 1


def test_orphans_are_refused_never_handed_to_the_engine() -> None:
    wedge, watch, engine, _ = _setup(ReclaimOutcome(freed_block_ids=(1,)), orphan=True,
                                     after=1)
    _steps(wedge, watch, 4)
    assert [o.kind.value for o in engine.handed] == ["finished_request"]
    s = watch.state()
    assert s.refused_total == {RefusalReason.OWNER_UNKNOWN.value: 1}
    assert [(e.cause.value, e.reclaimed, e.block_ids) for e in s.recent if not e.reclaimed] \
        == [("orphan", False, [11])]


def test_a_free_path_that_raises_is_contained_counted_and_refused() -> None:
    wedge, watch, engine, _ = _setup(RuntimeError("vLLM changed"), after=1)
    _steps(wedge, watch, 4)
    assert len(engine.handed) == 1
    assert watch.host.errors.by_hook == {"reclaim": 1}
    assert watch.state().refused_total == {"failed": 1}
    assert watch.state().recent[0].detail == "the free path raised RuntimeError"


def test_nothing_is_judged_while_no_new_wedge_verdict_came() -> None:
    wedge, watch, engine, q = _setup(ReclaimOutcome(freed_block_ids=(1,)), after=1)
    q.waiting = []
    _steps(wedge, watch, 50)
    assert wedge.last is None and engine.handed == [] and watch.state().recent == []
