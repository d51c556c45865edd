"""The online audit on this vLLM's real scheduler under load that never drains.

The load keeps more requests than ``max_num_seqs`` in the scheduler at every step, so
no drained checkpoint is ever taken; only the online audit judges. Healthy: many full
sweeps, no report. A leak injected in vLLM's path: an online leak report naming the
blocks vLLM's own tables still hold for a request vLLM no longer has.
"""

from __future__ import annotations

from collections.abc import Callable

from _sched import MixedLoad, Sched, leaked_ids, prompt

from kvguard.chaos.faults import Fault, FaultPlan
from kvguard.chaos.faults.scheduler import ChaosScheduler
from kvguard.core.report import CheckpointReport
from kvguard.core.types import LeakCause, LeakPath, Verdict

ONLINE = {"KVGUARD_ONLINE_BUDGET_FRACTION": "0.5", "KVGUARD_DELAYED_FREE_BOUND_SECONDS": "1"}
"""A large audit budget (steps here take microseconds, not a model's milliseconds) and a
short hold bound, so that sweeps and confirmations take few steps."""


def _sweeps(s: Sched) -> int:
    online = s.guard.online
    assert online is not None, "the online audit is off"
    return online.stats.sweeps_total


def _leaks(s: Sched) -> list[CheckpointReport]:
    return [r for r in s.online_reports() if r.verdict is Verdict.LEAK]


def test_online_audit_is_clean_under_load(sched: Callable[..., Sched]) -> None:
    s = sched(num_blocks=32, max_num_seqs=4, env=ONLINE)
    load = MixedLoad(s, seed=3, concurrency=7)
    load.run_until(lambda: _sweeps(s) >= 20 and s.steps >= 800)
    assert not [r for r in s.guard.reports if r.drained], "the load drained"
    online = s.online_reports()
    assert online, "the online audit never reported"
    assert [(r.verdict, r.leaks) for r in online] == [(Verdict.CLEAN, [])] * len(online), \
        [r.explanation for r in online]
    assert s.preemptions > 0 and load.aborted > 0 and s.prefix_cache_hits > 0
    print(f"[online] clean: {_sweeps(s)} sweeps in {s.steps} steps")


def _under_load_until_leak(s: Sched, load: MixedLoad) -> CheckpointReport:
    load.run_until(lambda: bool(_leaks(s)))
    return _leaks(s)[-1]


def test_online_audit_catches_a_leak_under_load(sched: Callable[..., Sched]) -> None:
    s = sched(num_blocks=64, max_num_seqs=4, scheduler_cls=ChaosScheduler, env=ONLINE)
    load = MixedLoad(s, seed=4, concurrency=7, abort_every=10**9)
    load.run_until(lambda: _sweeps(s) >= 3)
    victim = s.add(prompt(30, 70), 100)  # no prefix shared with the load
    load.run_until(lambda: len(s.table(victim)) >= 5)
    s.scheduler.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
    s.abort(victim)
    report = _under_load_until_leak(s, load)
    truth = s.pool_truth()
    held = {b for rid, ids in truth.tables.items() if rid not in s.scheduler.requests
            for b in ids}  # vLLM's tables for a request vLLM itself let go
    assert held and s.status(victim) == "FINISHED_ABORTED"
    assert leaked_ids(report) == held
    assert [(lk.cause, lk.path, lk.request_id) for lk in report.leaks] == [
        (LeakCause.FINISHED_REQUEST, LeakPath.ABORT, victim)]
    print(f"[online] caught {sorted(held)} after {_sweeps(s)} sweeps, {s.steps} steps")


def test_deferred_free_never_released_is_caught_online(sched: Callable[..., Sched]) -> None:
    """The parked free blocks every drained checkpoint: only the online audit judges it."""
    s = sched(num_blocks=64, max_num_seqs=4, scheduler_cls=ChaosScheduler, env=ONLINE)
    s.scheduler.arm(FaultPlan({Fault.DEFERRED_FREE_NEVER_RELEASED: 1}))
    parked = s.add(prompt(20, 70), 6)
    s.run_to_completion()
    assert len(s.scheduler.deferred_frees) == 1, "vLLM did not park the free"
    [(_, blocks)] = list(s.scheduler.deferred_frees)
    parked_ids = {b.block_id for b in blocks}
    report = _under_load_until_leak(s, MixedLoad(s, seed=5, concurrency=7))
    assert leaked_ids(report) == parked_ids
    assert [(lk.cause, lk.path, lk.request_id) for lk in report.leaks] == [
        (LeakCause.FINISHED_REQUEST, LeakPath.DEFERRED_FREE, parked)]
    assert all(s.pool.blocks[b].ref_cnt > 0 for b in parked_ids)
