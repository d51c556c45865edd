"""The wedge verdict (kvguard.core.wedge, dead_owners, wedge_monitor) on the real ledger.

What a user relies on: a pool held by live owners (long generations, a burst, delayed
frees within their bound) is never called wedged, whatever waits and for however long;
a pool whose blocks a dead owner holds, with a request that cannot be admitted, is
named wedged with the owner, its blocks and what must come back. The engine side is a
plain ``WaitingSource`` here; tests/vllm/test_wedge_engine.py checks it on vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from _pool import Harness, RefAdapter
from _sinks import ListSink
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.config import KvguardConfig
from kvguard.core.dead_owners import dead_owners
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.session import GuardSession
from kvguard.core.types import AcquireKind, FinishReason, LeakCause, RequestId
from kvguard.core.wedge import (
    DeadOwner,
    DeadOwnerKind,
    Stall,
    WaitingView,
    WedgeOptions,
    judge_wedge,
)
from kvguard.core.wedge_monitor import WedgeMonitor, session_dead_owners

CAPACITY = 63
BOUND = 30.0
OPTS = WedgeOptions(after_seconds=5.0, after_steps=3)


def _view(need: int, free: int, waiting: int = 1, running: int = 0) -> WaitingView:
    return WaitingView(num_waiting=waiting, num_running=running, oldest_wait_seconds=60.0,
                       head_blocks_needed=need, num_free_blocks=free,
                       capacity_blocks=CAPACITY)


LONG_STALL = Stall(seconds=3600.0, steps=10_000)


# ------------------------------------------------------------------ the judgment
@settings(max_examples=300, deadline=None)
@given(need=st.integers(0, 200), free=st.integers(0, CAPACITY), waiting=st.integers(0, 500),
       running=st.integers(0, 64), secs=st.floats(0, 1e6), steps=st.integers(0, 10**7))
def test_no_dead_block_is_never_wedged(need: int, free: int, waiting: int, running: int,
                                       secs: float, steps: int) -> None:
    v = judge_wedge(_view(need, free, waiting, running), Stall(secs, steps), [], OPTS, now=1.0)
    assert not v.wedged and v.blocks_to_return == 0


def test_dead_blocks_that_starve_the_head_are_a_wedge() -> None:
    dead = [DeadOwner(DeadOwnerKind.FINISHED_REQUEST, "r1", frozenset(range(1, 61)), 40.0)]
    v = judge_wedge(_view(need=8, free=3), LONG_STALL, dead, OPTS, now=1.0)
    assert v.wedged
    assert (v.dead_blocks, v.blocks_to_return, v.head_blocks_needed, v.free_blocks) == \
        (60, 5, 8, 3)
    assert v.dead_owners[0].request_id == "r1" and v.dead_owners[0].blocks == 60
    assert "r1" in v.explanation and "WEDGED" in v.explanation


def test_a_small_leak_beside_live_requests_that_will_finish_is_busy_not_wedged() -> None:
    # 5 dead blocks, 50 held by running requests: once they finish the head fits.
    dead = [DeadOwner(DeadOwnerKind.ORPHAN, None, frozenset(range(1, 6)))]
    v = judge_wedge(_view(need=20, free=8, running=4), LONG_STALL, dead, OPTS, now=1.0)
    assert not v.wedged and v.dead_blocks == 5


def test_a_stall_below_either_threshold_is_not_judged_wedged() -> None:
    dead = [DeadOwner(DeadOwnerKind.ORPHAN, None, frozenset(range(1, 61)))]
    assert not judge_wedge(_view(8, 3), Stall(4.9, 100), dead, OPTS, now=1.0).wedged
    assert not judge_wedge(_view(8, 3), Stall(100.0, 2), dead, OPTS, now=1.0).wedged
    assert judge_wedge(_view(8, 3), Stall(5.0, 3), dead, OPTS, now=1.0).wedged


# --------------------------------------------------------- dead owners from the ledger
@dataclass
class _Run:
    ledger: OwnershipLedger
    held: set[int]


_ops = st.lists(st.tuples(st.sampled_from(["live", "delayed", "prefix"]),
                          st.integers(1, 6)), min_size=0, max_size=12)


def _live_pool(ops: list[tuple[str, int]], now: float) -> _Run:
    """A ledger where every held block belongs to a live request, or to a delayed free
    inside its bound, or is shared (prefix hit) with a live request."""
    ledger = OwnershipLedger()
    nxt, held, live_blocks = 1, set(), []
    for i, (kind, n) in enumerate(ops):
        rid = RequestId(f"r{i}")
        ledger.on_request_admitted(rid, now - 100)
        ids = list(range(nxt, nxt + n))
        nxt += n
        ledger.on_blocks_acquired(rid, ids, AcquireKind.ALLOCATE)
        held.update(ids)
        if kind == "live":
            live_blocks.extend(ids)
        elif kind == "delayed":
            ledger.on_request_finished(rid, FinishReason.STOPPED, now - 1)
            ledger.on_delayed_free_started(rid, now - 1)
        elif kind == "prefix" and live_blocks:
            # a finished, freed request that shares a live request's blocks
            ledger.on_blocks_acquired(rid, live_blocks[:n], AcquireKind.PREFIX_HIT)
            ledger.on_blocks_released(rid, ids)
            held.difference_update(ids)
            ledger.on_request_finished(rid, FinishReason.STOPPED, now - 50)
            ledger.on_request_freed(rid, now - 50)
    return _Run(ledger, held)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, need=st.integers(1, 80), waiting=st.integers(1, 50))
def test_a_pool_held_by_live_owners_is_never_wedged(ops: list[tuple[str, int]], need: int,
                                                     waiting: int) -> None:
    now = 1000.0
    run = _live_pool(ops, now)
    owners = dead_owners(run.ledger, now=now, bound_seconds=BOUND)
    assert owners == []
    free = CAPACITY - len(run.held)
    v = judge_wedge(_view(need, max(0, free), waiting), LONG_STALL, owners, OPTS, now=now)
    assert not v.wedged


def test_dead_owners_name_finished_requests_past_their_hold_and_audit_orphans() -> None:
    now = 1000.0
    ledger = OwnershipLedger()
    for rid in ("aborted", "lapsed", "live"):
        ledger.on_request_admitted(RequestId(rid), now - 100)
    ledger.on_blocks_acquired(RequestId("aborted"), [1, 2, 3], AcquireKind.ALLOCATE)
    ledger.on_blocks_acquired(RequestId("lapsed"), [4, 5], AcquireKind.ALLOCATE)
    ledger.on_blocks_acquired(RequestId("live"), [6], AcquireKind.ALLOCATE)
    ledger.on_blocks_acquired(RequestId("aborted"), [6], AcquireKind.PREFIX_HIT)
    ledger.on_request_finished(RequestId("aborted"), FinishReason.ABORTED, now - 20)
    ledger.on_request_freed(RequestId("aborted"), now - 20)  # free skipped: still holds
    ledger.on_request_finished(RequestId("lapsed"), FinishReason.STOPPED, now - 40)
    ledger.on_delayed_free_started(RequestId("lapsed"), now - 40)  # past the 30 s bound
    owners = dead_owners(ledger, now=now, bound_seconds=BOUND,
                         confirmed_causes={9: [LeakCause.ORPHAN], 6: [LeakCause.DOUBLE_FREE]})
    got = {(o.kind, o.request_id, o.block_ids) for o in owners}
    assert got == {
        # block 6 is shared with a live request: it comes back when that one is done
        (DeadOwnerKind.FINISHED_REQUEST, "aborted", frozenset({1, 2, 3})),
        (DeadOwnerKind.DELAYED_FREE, "lapsed", frozenset({4, 5})),
        (DeadOwnerKind.ORPHAN, None, frozenset({9})),
    }


# ------------------------------------------------------------------- the monitor
class _Queue:
    """A waiting queue the test moves by hand."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.running = 0
        self.free = 3
        self.need = 8
        self.reads = 0

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return self.running

    def head_request_id(self) -> str | None:
        return self.waiting[0] if self.waiting else None

    def read(self, now: float) -> WaitingView:
        self.reads += 1
        return WaitingView(len(self.waiting), self.running, 10.0, self.need, self.free,
                           CAPACITY)


def test_monitor_names_a_wedge_once_after_both_thresholds_and_clears_on_admission() -> None:
    q = _Queue()
    dead = [DeadOwner(DeadOwnerKind.FINISHED_REQUEST, "r0", frozenset(range(1, 61)))]

    def owners(now: float) -> list[DeadOwner]:
        return dead

    mon = WedgeMonitor(q, owners, OPTS)
    assert mon.on_step_end(0.0, 0.0) is None and q.reads == 0  # nothing waits: no read
    q.waiting = ["a", "b"]
    verdicts = [mon.on_step_end(100.0 + t, float(t)) for t in range(10)]
    named = [v for v in verdicts if v is not None]
    assert len(named) == 1 and named[0].wedged and mon.wedged
    assert verdicts.index(named[0]) == 5  # 5 s and >= 3 steps after the stall began
    assert mon.state().verdicts_total == 1 and mon.report() is not None
    q.waiting = ["b"]  # the head was admitted
    assert mon.on_step_end(111.0, 11.0) is None
    assert not mon.wedged and mon.report() is None and mon.state().verdicts_total == 1


def test_monitor_never_collects_owners_while_the_queue_moves() -> None:
    q = _Queue()
    asked: list[float] = []

    def owners(now: float) -> list[DeadOwner]:
        asked.append(now)
        return []

    mon = WedgeMonitor(q, owners, OPTS)
    for t in range(100):
        q.waiting = [f"r{t}", "x"]  # a new head every step: admissions go on
        assert mon.on_step_end(float(t), float(t)) is None
    assert asked == [] and q.reads == 0 and not mon.wedged


# ------------------------------------------------------- inside a guard session
def _session_with_queue(q: _Queue) -> tuple[GuardSession, ListSink, Harness]:
    h = Harness(CAPACITY + 1)
    sink = ListSink()
    cfg = KvguardConfig.from_env({}, publish_interval_seconds=0.0, online_audit=False)
    s = GuardSession(RefAdapter(h), cfg, engine="ref0", sink=sink)
    h.ledger = s.ledger
    s.wedge = WedgeMonitor(q, lambda now: session_dead_owners(s, now),
                           WedgeOptions(after_seconds=0.0, after_steps=3), engine="ref0")
    return s, sink, h


def test_a_session_names_the_wedge_its_ledger_proves_and_publishes_it() -> None:
    q = _Queue()
    s, sink, h = _session_with_queue(q)
    victim = h.admit()
    h.allocate(victim, 60, hash_mask=[False] * 60, attributed=True)
    h.skip_free_on_abort(victim)  # its 60 blocks stay referenced, the engine forgot it
    q.waiting, q.free, q.need = ["next"], 3, 8
    for _ in range(5):
        s.on_step_end(step_seconds=0.001)
    w = s.state().wedge
    assert w is not None and w.wedged and w.verdicts_total == 1 and w.last is not None
    [owner] = w.last.dead_owners
    assert (owner.kind, owner.request_id, owner.blocks) == \
        (DeadOwnerKind.FINISHED_REQUEST, victim.client_id, 60)
    assert sink.states[-1].wedge == w and s.errors.total == 0


def test_a_failing_wedge_monitor_is_contained_and_counted() -> None:
    q = _Queue()
    s, _, _ = _session_with_queue(q)

    def broken() -> int:
        raise RuntimeError("queue renamed")

    q.num_waiting = broken  # type: ignore[method-assign]
    s.on_step_end(step_seconds=0.001)  # the engine goes on
    assert s.errors.by_hook["wedge"] == 1 and s.errors.ledger_errors == 0
