"""The online audit against the reference pool: budget, sweeps, confirmation, verdicts.

The harness plays an engine that never drains (live requests at every audit)
and uses vLLM's real hook style: pool calls carry no request id and a
request's table is claimed only at its transitions, or by the audit's claim
phase. ``ONE_UNIT`` makes the auditor do exactly one unit of work per step
(one claim chunk or one slice), so that sweeps are deterministic.
"""

from __future__ import annotations

import pytest
from _pool import Harness, HarnessPoolAccess, Req, random_clean_ops
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.core.online import (
    OnlineAuditor,
    OnlineOptions,
    StepBudget,
    SweepResult,
    judge_fingerprint,
)
from kvguard.core.types import BlockId, BlockState, Evidence, FinishReason, LeakCause, LeakPath

SLICE = 16
ONE_UNIT = OnlineOptions(budget_fraction=1.0, max_pause_seconds=1e-12, slice_blocks=SLICE,
                         claim_requests=4)


class Driver:
    """Steps the auditor once per engine 'step' of 1 s of fake engine time."""

    def __init__(self, h: Harness, opts: OnlineOptions = ONE_UNIT) -> None:
        self.h = h
        self.auditor = OnlineAuditor(HarnessPoolAccess(h), h.ledger, opts)
        self.sweeps: list[SweepResult] = []
        self.steps = 0

    def step(self) -> SweepResult | None:
        self.steps += 1
        r = self.auditor.step(1.0, self.h.t)
        if r is not None:
            self.sweeps.append(r)
        return r

    def sweep(self) -> SweepResult:
        """Step until one more sweep completes."""
        n = len(self.sweeps)
        for _ in range(10_000):
            self.step()
            if len(self.sweeps) > n:
                return self.sweeps[-1]
        raise AssertionError("no sweep completed in 10,000 steps")


def busy_engine(num_blocks: int = 64) -> tuple[Harness, list[Req]]:
    """Four live requests holding blocks, claimed lazily (never drained)."""
    h = Harness(num_blocks, lazy_claims=True)
    reqs = []
    for _ in range(4):
        r = h.admit()
        h.allocate(r, 3, hash_mask=[True, False, False], attributed=False)
        reqs.append(r)
    return h, reqs


# ------------------------------------------------------------------- budget
def test_budget_earns_a_fraction_of_step_time_and_caps_a_single_pause() -> None:
    b = StepBudget(0.01, max_credit=0.002)
    assert b.earn(0.0) == 0.0
    assert b.earn(0.1) == pytest.approx(0.001)
    b.spend(0.003)  # one unit may overdraw...
    assert b.earn(0.1) == pytest.approx(-0.001)  # ...and later steps repay it
    assert b.earn(100.0) == pytest.approx(0.002)  # a long step buys at most the cap


def test_time_spent_never_exceeds_the_fraction_over_a_run() -> None:
    """Long-run audit time <= fraction x scheduler time + one unit, whatever the unit."""
    b = StepBudget(0.01, max_credit=0.002)
    spent = 0.0
    unit = 0.0007  # a unit dearer than one step's earnings
    engine = 0.0
    for _ in range(10_000):
        engine += 0.0006  # 600 us of scheduler time per step
        credit = b.earn(0.0006)
        used = 0.0
        while used < credit:
            used += unit
        b.spend(used)
        spent += used
    assert spent <= 0.01 * engine + unit


# ---------------------------------------------------------------- healthy
def test_a_sweep_covers_the_pool_once_and_the_states_sum_to_capacity() -> None:
    h, reqs = busy_engine(64)
    d = Driver(h)
    first = d.sweep()
    second = d.sweep()
    assert first.states.total == h.pool.capacity == 63
    assert second.states.total == 63
    assert not first.can_confirm and second.can_confirm
    # 4 requests in one claim chunk + ceil(64 / 16) slices.
    assert second.steps == 1 + 4
    assert second.states[BlockState.ACTIVE] == 12
    assert second.findings == []
    assert sum(len(r.blocks) for r in reqs) == 12


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_healthy_engine_that_never_drains_gets_no_online_finding(data: st.DataObject) -> None:
    """Random healthy traffic between every audit step: nothing is ever confirmed."""
    h, _ = busy_engine(48)
    d = Driver(h)
    for _ in range(60):
        random_clean_ops(h, data, 3, style="pool")
        if not h.live():
            h.admit()
        d.step()
        assert not d.auditor.confirmed, [c.findings for c in d.auditor.confirmed.values()]
    assert len(d.sweeps) >= 5
    assert all(s.states.total == h.pool.capacity for s in d.sweeps)
    assert all(not s.findings for s in d.sweeps)


def test_a_block_not_claimed_yet_is_suspect_once_but_never_confirmed() -> None:
    h, reqs = busy_engine(64)
    d = Driver(h)
    d.sweep()
    # Allocated after the claim phase of the next sweep began: unclaimed when audited.
    d.step()  # claim phase of sweep 2 done
    h.allocate(reqs[0], 2, hash_mask=[False, False], attributed=False)
    d.sweep()
    assert d.auditor.pending_blocks == 2  # seen once, unclaimed
    d.sweep()  # claimed by sweep 3's claim phase: consistent now
    assert d.auditor.pending_blocks == 0 and not d.auditor.confirmed


def test_a_block_freed_and_taken_again_between_audits_is_not_confirmed() -> None:
    """Same block, unclaimed at two consecutive audits, but two different acquisitions."""
    h, reqs = busy_engine(32)
    d = Driver(h, OnlineOptions(budget_fraction=1.0, max_pause_seconds=1e-12, slice_blocks=64,
                                claim_requests=16))
    d.sweep()  # from here on a sweep is two steps: claim phase, then the one slice
    d.step()  # claim phase
    [b] = h.allocate(reqs[0], 1, hash_mask=[False], attributed=False)
    d.step()  # the slice: b is unclaimed
    assert d.auditor.pending_blocks == 1
    d.step()  # claim phase of the next sweep
    # b's request finishes and b goes to a newcomer, unclaimed again, before the slice.
    h.finish(reqs[0], FinishReason.STOPPED, attributed=False)
    newcomer = h.admit()
    h.pool.queue.remove(b)
    h.pool.queue.insert(0, b)
    assert h.allocate(newcomer, 1, hash_mask=[False], attributed=False) == [b]
    d.step()  # the slice: b unclaimed again, but by another acquisition
    assert not d.auditor.confirmed
    assert d.auditor.pending_blocks == 1


# ------------------------------------------------------------------ faults
def detect(d: Driver, within_sweeps: int = 3) -> SweepResult:
    """Sweeps until a sweep reports findings; fails after ``within_sweeps`` sweeps."""
    for _ in range(within_sweeps):
        r = d.sweep()
        if r.findings:
            return r
    raise AssertionError(f"nothing confirmed in {within_sweeps} sweeps")


def test_abort_that_skips_the_free_is_confirmed_online_with_its_request() -> None:
    h, reqs = busy_engine(64)
    d = Driver(h)
    d.sweep()
    d.step()
    d.step()  # mid-sweep: the leak appears after part of the pool was audited
    leak = h.skip_free_on_abort(reqs[1])
    r = detect(d, within_sweeps=3)
    [f] = r.findings
    assert (f.cause, f.path, f.request_id) == (LeakCause.FINISHED_REQUEST, LeakPath.ABORT,
                                               leak.rid)
    assert f.evidence is Evidence.ONLINE and f.blocks == len(leak.blocks) == 3
    assert f.finish_reason is FinishReason.ABORTED
    assert f.held_for_seconds is not None and f.held_for_seconds >= 0
    assert r.states[BlockState.HELD_BY_FINISHED] == 3


def test_a_reference_bumped_behind_every_hook_is_refcount_drift_on_a_live_block() -> None:
    h, reqs = busy_engine(64)
    d = Driver(h)
    d.sweep()
    victim = reqs[2].blocks[0]
    h.bump_ref(victim)
    r = detect(d)
    [f] = r.findings
    assert f.cause is LeakCause.REFCOUNT_DRIFT and f.block_ids == [victim]


def test_a_stray_reference_on_a_free_block_is_an_orphan() -> None:
    h, _ = busy_engine(64)
    d = Driver(h)
    d.sweep()
    stray = h.pool.queue[-1]
    h.bump_ref(stray)
    [f] = detect(d).findings
    assert f.cause is LeakCause.ORPHAN and f.block_ids == [stray] and f.request_id is None


def test_double_free_is_confirmed_online() -> None:
    h, reqs = busy_engine(64)
    d = Driver(h)
    d.sweep()
    victim = reqs[3]
    # The free hooks run with the request named (vLLM's _free_request_blocks).
    h.finish(victim, FinishReason.ABORTED, attributed=True,
             double_free_block=victim.blocks[-1])
    r = detect(d)
    causes = {f.cause for f in r.findings}
    assert causes == {LeakCause.DOUBLE_FREE}
    [f] = r.findings
    assert f.request_id == victim.rid and f.path is LeakPath.ABORT


def test_a_delayed_free_is_legitimate_until_its_bound_then_a_leak() -> None:
    h, reqs = busy_engine(64)
    opts = OnlineOptions(budget_fraction=1.0, max_pause_seconds=1e-12, slice_blocks=SLICE,
                         claim_requests=4, delayed_free_bound_seconds=10.0)
    d = Driver(h, opts)
    r = reqs[0]
    at = h.tick()
    h.ledger.claim(r.rid, r.blocks)
    h.ledger.on_request_finished(r.rid, FinishReason.STOPPED, at)
    h.ledger.on_delayed_free_started(r.rid, at)  # the connector keeps the blocks
    r.phase = "finished"
    for _ in range(3):
        assert d.sweep().findings == []  # within the bound (the fake clock barely moves)
    h.tick(20.0)  # past the bound
    [f] = detect(d).findings
    assert (f.cause, f.path, f.request_id) == (LeakCause.FINISHED_REQUEST,
                                               LeakPath.DELAYED_FREE, r.rid)


def test_a_leak_that_is_fixed_before_confirmation_is_never_reported() -> None:
    h, _ = busy_engine(64)
    d = Driver(h)
    d.sweep()
    stray = h.pool.queue[-1]
    h.bump_ref(stray)
    d.sweep()
    assert d.auditor.pending_blocks == 1
    h.pool.free_blocks([stray])  # whoever took it gave it back
    h.bumps[stray] -= 1
    assert d.sweep().findings == []
    assert d.auditor.pending_blocks == 0


def test_a_confirmed_leak_that_goes_away_leaves_the_next_sweep_clean() -> None:
    h, _ = busy_engine(64)
    d = Driver(h)
    d.sweep()
    stray = h.pool.queue[-1]
    h.bump_ref(stray)
    assert detect(d).findings
    h.pool.free_blocks([stray])
    assert d.sweep().findings == []


def test_fingerprint_of_consistent_and_suspect_blocks() -> None:
    h, reqs = busy_engine(16)
    for r in reqs:
        h.ledger.claim(r.rid, r.blocks)
    b = BlockId(reqs[0].blocks[0])
    state, fp = judge_fingerprint(b, 1, True, None, h.ledger, h.t, 30.0)
    assert (state, fp) == (BlockState.ACTIVE, None)
    state, fp = judge_fingerprint(b, 2, True, None, h.ledger, h.t, 30.0)
    # A fingerprint names the state and the causes the shared classifier charged.
    assert state is BlockState.ACTIVE and fp is not None and fp[:2] == ("active",
                                                                         ("refcount_drift",))
    state, fp = judge_fingerprint(b, 1, True, True, h.ledger, h.t, 30.0)
    assert fp is not None and fp[1] == ("double_free",)  # referenced, yet in the free queue
    free = BlockId(h.pool.queue[0])
    assert judge_fingerprint(free, 0, False, True, h.ledger, h.t, 30.0) == (BlockState.FREE,
                                                                           None)
    state, fp = judge_fingerprint(free, 0, False, False, h.ledger, h.t, 30.0)
    assert state is BlockState.ORPHANED and fp is not None and fp[1] == ("orphan",)


def test_a_block_shared_with_a_transfer_in_flight_names_only_the_leaking_request() -> None:
    h, reqs = busy_engine(64)
    a, b = reqs[0], h.admit()
    shared = a.blocks[0]  # hashed: a prefix hit for b
    h.prefix_hit(b, [shared], attributed=False)
    at = h.tick()
    h.ledger.claim(a.rid, a.blocks)
    h.ledger.on_request_finished(a.rid, FinishReason.STOPPED, at)
    h.ledger.on_delayed_free_started(a.rid, at)  # a: transfer in flight, within the bound
    a.phase = "finished"
    leak = h.skip_free_on_abort(b)  # b: aborted, its free skipped
    d = Driver(h)
    r = detect(d)
    assert {f.request_id for f in r.findings} == {leak.rid}
    assert all(f.path is LeakPath.ABORT for f in r.findings)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_at_a_drained_moment_both_audits_find_the_same_leaks(data: st.DataObject) -> None:
    """One classifier: online sweeps and a drained checkpoint of the same pool agree on
    every finding (cause, request, path, blocks) and on every block's state."""
    h = Harness(64, lazy_claims=True)
    random_clean_ops(h, data, data.draw(st.integers(5, 30), label="n_ops"), style="mixed")
    for _ in range(data.draw(st.integers(0, 2), label="n_leaks")):
        live = [r for r in h.live() if r.blocks]
        if live:
            h.skip_free_on_abort(data.draw(st.sampled_from(live), label="victim"))
    for _ in range(data.draw(st.integers(0, 2), label="n_bumps")):
        h.bump_ref(data.draw(st.sampled_from(h.bump_candidates()), label="bump"))
    live = [r for r in h.live() if r.blocks]
    if live and data.draw(st.booleans(), label="double_free"):
        victim = data.draw(st.sampled_from(live), label="double_freed")
        h.finish(victim, FinishReason.ABORTED, attributed=True,
                 double_free_block=victim.blocks[-1])
    h.drain(attributed=data.draw(st.booleans(), label="drain_attributed"))
    drained = h.reconcile(walk_free_queue=True)
    d = Driver(h)
    for _ in range(3):
        online = d.sweep()

    def key(fs: list) -> list[tuple]:
        return sorted((f.cause, f.request_id, f.path, sorted(f.all_block_ids)) for f in fs)

    assert key(online.findings) == key(drained.findings)
    assert online.states.by_state() == drained.states.by_state()
