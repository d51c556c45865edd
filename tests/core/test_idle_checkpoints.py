"""An idle engine is judged without a request: ``GuardSession.on_idle`` and the waker it arms.

The session asks its ``IdleWaker`` to run ``on_idle`` on the engine's thread when a drain
is held up only by a legitimate hold (until that hold's bound), or let go by the pace
(until the pace allows); a checkpoint asked for is answered there too. Here the test is
the engine thread: it calls ``on_idle`` when the fake waker says it would. The truth is
the reference pool (what the harness leaked on purpose). The real engine's twin is
``tests/observability/test_idle_engine.py``.
"""

from __future__ import annotations

import time

from _pool import Harness, RefAdapter, Req
from _sinks import AskOnce, ListSink

from kvguard.config import KvguardConfig
from kvguard.core.engine import EngineActivity
from kvguard.core.session import GuardSession
from kvguard.core.types import FinishReason, LeakCause, LeakPath, Verdict

BOUND_S = 0.3


class HoldingAdapter(RefAdapter):
    """The reference engine, plus finished requests it still keeps (a delayed free) and
    deferred frees it has not released."""

    def __init__(self, h: Harness) -> None:
        super().__init__(h)
        self.held: list[Req] = []
        self.deferred = 0

    def request_tables(self) -> dict[str, list[int]]:
        return super().request_tables() | {r.rid: list(r.blocks) for r in self.held}

    def activity(self) -> EngineActivity:
        act = super().activity()
        return EngineActivity(running=act.running, waiting=act.waiting,
                              deferred_frees=self.deferred, unfinished=None,
                              finished_held=tuple(r.rid for r in self.held))


class FakeWaker:
    def __init__(self) -> None:
        self.wakes: list[float] = []
        self.closed = False

    def wake_after(self, seconds: float) -> None:
        self.wakes.append(seconds)

    def close(self) -> None:
        self.closed = True


def _session(h: Harness, **config: object
             ) -> tuple[GuardSession, HoldingAdapter, FakeWaker, AskOnce]:
    asks, waker = AskOnce(), FakeWaker()
    settings_: dict[str, object] = {"publish_interval_seconds": 0.0, "online_audit": False,
                                    "delayed_free_bound_seconds": BOUND_S}
    adapter = HoldingAdapter(h)
    s = GuardSession(adapter, KvguardConfig.from_env({}, **(settings_ | config)),
                     engine="ref0", sink=ListSink(), requests=asks)
    h.ledger = s.ledger
    s.idle_waker = waker
    return s, adapter, waker, asks


def _delayed_free(h: Harness, s: GuardSession, adapter: HoldingAdapter) -> Req:
    """A request that finished now and whose blocks the engine keeps for a transfer."""
    r = h.admit()
    h.allocate(r, 3, hash_mask=[True, True, False], attributed=True)
    now = time.time()
    s.on_finished(r.rid, FinishReason.STOPPED, now)
    s.on_delayed_free_started(r.rid, now)
    r.phase = "finished"
    adapter.held.append(r)
    return r


def test_a_drain_held_by_a_delayed_free_is_judged_by_the_idle_wake_at_its_bound() -> None:
    h = Harness(64)
    s, adapter, waker, _ = _session(h)
    r = _delayed_free(h, s, adapter)
    s.on_step_end()  # the step that finished it: drained but for the hold
    assert not s.reports and s.drain_held_until is not None
    assert waker.wakes and 0 < waker.wakes[-1] <= BOUND_S
    s.on_idle()  # woken early (e.g. the engine went idle): still within the bound
    assert not s.reports and waker.wakes[-1] <= BOUND_S
    time.sleep(BOUND_S + 0.05)
    s.on_idle()  # the wake at the bound: no request, no step
    [rep] = s.reports
    assert rep.drained and rep.verdict is Verdict.LEAK
    [f] = rep.leaks
    assert (f.cause, f.path, f.request_id) == (LeakCause.FINISHED_REQUEST,
                                               LeakPath.DELAYED_FREE, r.rid)
    assert sorted(f.block_ids) == sorted(r.blocks)  # the reference pool's truth
    assert s.drain_held_until is None
    s.on_idle()  # nothing waits any more: no second report
    assert len(s.reports) == 1


def test_a_hold_released_before_its_bound_leaves_the_idle_engine_clean() -> None:
    h = Harness(64)
    s, adapter, _, _ = _session(h)
    r = _delayed_free(h, s, adapter)
    s.on_step_end()
    adapter.held.remove(r)  # the transfer completed: the engine frees the blocks
    h.pool.free_blocks(r.blocks)
    s.on_blocks_freed(r.rid, list(r.blocks))
    s.on_freed(r.rid, time.time())
    r.blocks = []
    s.on_step_end()
    [rep] = s.reports
    assert rep.drained and rep.verdict in (Verdict.CLEAN, Verdict.SATURATED)
    time.sleep(BOUND_S + 0.05)
    s.on_idle()
    assert len(s.reports) == 1  # nothing was owed


def test_a_checkpoint_asked_for_while_idle_is_taken_by_on_idle() -> None:
    h = Harness(64)
    s, _, _, asks = _session(h)
    r = h.admit()
    h.allocate(r, 2, hash_mask=[True, False], attributed=True)
    h.drain()
    s.on_release_done()
    s.on_step_end()
    assert len(s.reports) == 1
    asks.asked = True  # POST /v1/checkpoints; the engine takes no step
    s.on_idle()
    assert len(s.reports) == 2 and s.reports[-1].drained
    assert s.reports[-1].verdict in (Verdict.CLEAN, Verdict.SATURATED)


def test_a_checkpoint_asked_for_within_a_hold_is_skipped_then_the_hold_is_judged() -> None:
    h = Harness(64)
    s, adapter, waker, asks = _session(h)
    _delayed_free(h, s, adapter)
    asks.asked = True
    s.on_idle()
    [skipped] = s.reports
    assert skipped.verdict is Verdict.SKIPPED and "waits for its KV transfer" in (
        skipped.skip_reason or "")
    assert waker.wakes and s.drain_held_until is not None  # judged again at the bound
    time.sleep(BOUND_S + 0.05)
    s.on_idle()
    assert s.reports[-1].verdict is Verdict.LEAK and s.reports[-1].drained


def test_deferred_frees_left_on_an_idle_engine_block_a_drain_for_the_bound_only() -> None:
    h = Harness(64)
    s, adapter, waker, _ = _session(h)
    adapter.deferred = 1
    s.on_release_done()
    s.on_step_end()
    assert not s.reports and waker.wakes and waker.wakes[-1] <= BOUND_S
    time.sleep(BOUND_S + 0.05)
    s.on_idle()
    [rep] = s.reports
    assert rep.drained  # judged: a deferred free with nothing in flight is no longer owed


def test_a_hold_past_its_bound_is_judged_at_the_next_admission_without_a_waker() -> None:
    """The in-process engine: nothing steps it while idle, and it has no waker."""
    h = Harness(64)
    s, adapter, _, _ = _session(h)
    s.idle_waker = None
    _delayed_free(h, s, adapter)
    s.on_step_end()
    s.on_admitting()  # within the bound: nothing
    assert not s.reports
    time.sleep(BOUND_S + 0.05)
    s.on_admitting()  # the next request: audited before it enters
    [rep] = s.reports
    assert rep.drained and rep.verdict is Verdict.LEAK


def test_an_idle_engine_owing_a_paced_audit_is_woken_when_the_pace_allows() -> None:
    h = Harness(64, lazy_claims=True)
    s, _, waker, _ = _session(h, checkpoint_min_interval_seconds=0.2, checkpoint_burst=1)
    h.drain(attributed=False)
    s.on_release_done()
    s.on_step_end()
    assert len(s.reports) == 1  # the one token
    r = h.admit()
    h.allocate(r, 2, hash_mask=[True, False], attributed=False)
    leak = h.skip_free_on_abort(r)
    s.on_release_done()
    s.on_step_end()
    assert len(s.reports) == 1 and s.pacer.owed_since is not None
    assert waker.wakes and 0 < waker.wakes[-1] <= 0.2
    time.sleep(0.25)
    s.on_idle()
    assert len(s.reports) == 2 and s.pacer.owed_since is None
    rep = s.reports[-1]
    assert rep.drained and rep.verdict is Verdict.LEAK
    assert rep.leaked_blocks == len(set(leak.blocks))


def test_close_stops_the_waker() -> None:
    s, _, waker, _ = _session(Harness(16))
    s.close()
    assert waker.closed


def test_an_engine_that_stays_idle_is_audited_again_after_the_recheck_interval() -> None:
    """No traffic after a drain: the waker is armed for the recheck interval, and the
    on_idle it brings then audits the pool again, so the last drained checkpoint's time
    stays current (``KvguardNoDrainedCheckpoint`` no longer fires on an idle engine)."""
    h = Harness(64, lazy_claims=True)
    s, _, waker, _ = _session(h, idle_recheck_seconds=0.2)
    h.drain(attributed=False)
    s.on_release_done()
    s.on_step_end()
    assert len(s.reports) == 1 and s.reports[-1].verdict is Verdict.CLEAN
    assert 0.2 in waker.wakes
    s.on_idle()  # too early: nothing to do
    assert len(s.reports) == 1
    time.sleep(0.25)
    s.on_idle()
    assert len(s.reports) == 2 and s.reports[-1].drained
    assert s.reports[-1].verdict is Verdict.CLEAN
    assert s.reports[-1].taken_at > s.reports[0].taken_at


def test_the_idle_recheck_can_be_turned_off() -> None:
    h = Harness(64, lazy_claims=True)
    s, _, waker, _ = _session(h, idle_recheck_seconds=0.0)
    h.drain(attributed=False)
    s.on_release_done()
    s.on_step_end()
    time.sleep(0.05)
    s.on_idle()
    assert len(s.reports) == 1 and waker.wakes == []
