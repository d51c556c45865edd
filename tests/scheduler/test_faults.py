"""Every fault class that runs without a model, injected in this vLLM's own code paths.

The scheduler is kvguard's ``ChaosScheduler`` (a subclass of the venv's vLLM
``Scheduler``, loaded as the scheduler class); kvguard's hooks wrap it like any scheduler
and never learn that a fault exists. After the drain, kvguard's report must name exactly
the blocks vLLM's own pool still references (or freed past zero), with the bug class's
cause, path and request.

Left out here: ``spec_rollback_keeps_blocks`` (needs a drafter's proposals, i.e. a model)
and ``sliding_window_removal_skips_free`` (needs hybrid KV cache groups, covered by the
engine suite); ``deferred_free_never_released`` never drains: see test_online.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _sched import Sched, leaked_ids, prompt

from kvguard.chaos.faults import Fault, FaultPlan
from kvguard.chaos.faults.scheduler import ChaosScheduler
from kvguard.core.types import LeakCause, LeakPath, Verdict


def _skip_free_on_abort(s: Sched) -> str | None:
    victim = s.add(prompt(1, 70), 60)
    s.add(prompt(2, 30), 30)
    s.step_until(lambda: len(s.table(victim)) >= 5)
    s.abort(victim)
    s.run_to_completion()
    return victim


def _double_free_on_abort(s: Sched) -> str | None:
    victim = s.add(prompt(3, 70), 60)
    s.step_until(lambda: len(s.table(victim)) >= 5)
    s.abort(victim)  # drained now; the pool is corrupt, so no more steps
    return victim


def _refcount_bump(s: Sched) -> str | None:
    s.add(prompt(4, 70), 10)
    s.run_to_completion()
    return None


def _preemption_skips_free(s: Sched) -> str | None:
    for i in range(4):
        s.add(prompt(10 + i, 60), 150)
    s.run_to_completion()
    assert s.preemptions > 0, "vLLM preempted nothing"
    return str(s.scheduler.faults.fired[0][1])


def _prefix_hit_extra_ref(s: Sched) -> str | None:
    shared = prompt(5, 96)
    s.add(shared + prompt(6, 10), 8)
    s.run_to_completion()
    s.add(shared + prompt(7, 10), 8)  # hits the 6 cached prefix blocks
    s.run_to_completion()
    assert s.prefix_cache_hits > 0, "vLLM counted no prefix-cache hit"
    return None


# fault -> (drive it, build_scheduler keywords, cause, path or None when no hook can know it)
FAULTS: dict[Fault, tuple[Callable[[Sched], str | None], dict[str, object], LeakCause,
                          LeakPath | None]] = {
    Fault.SKIP_FREE_ON_ABORT: (_skip_free_on_abort, {}, LeakCause.FINISHED_REQUEST,
                               LeakPath.ABORT),
    Fault.DOUBLE_FREE_ON_ABORT: (_double_free_on_abort, {}, LeakCause.DOUBLE_FREE,
                                 LeakPath.ABORT),
    Fault.REFCOUNT_BUMP: (_refcount_bump, {}, LeakCause.ORPHAN, None),
    # Prefix caching off: with it, the preempted victim's re-admission hits its own leaked
    # (still cached) blocks, and kvguard then names the right blocks as an orphan of that
    # prefix hit instead of the victim's (a ledger attribution limit, vLLM 0.32 and 0.33
    # alike; the engine suite's 32-token blocks do not reach it).
    Fault.PREEMPTION_SKIPS_FREE: (_preemption_skips_free, {"num_blocks": 40,
                                                           "prefix_caching": False},
                                  LeakCause.FINISHED_REQUEST, LeakPath.PREEMPTION),
    Fault.PREFIX_HIT_EXTRA_REF: (_prefix_hit_extra_ref, {}, LeakCause.ORPHAN, None),
}


@pytest.mark.parametrize("fault", list(FAULTS), ids=str)
def test_each_fault_is_caught_with_the_block_ids_vllms_pool_still_references(
        sched: Callable[..., Sched], fault: Fault) -> None:
    drive, build, cause, path = FAULTS[fault]
    s = sched(**{"num_blocks": 64, **build}, max_num_seqs=4, scheduler_cls=ChaosScheduler,
              env={"KVGUARD_ONLINE_AUDIT": "0"})
    s.scheduler.arm(FaultPlan({fault: 1}))
    victim = drive(s)
    assert s.scheduler.faults.times_fired(fault) == 1, "vLLM did not take the fault's path"
    truth = s.pool_truth()
    assert truth.wrong_blocks, "the fault left vLLM's pool clean"
    report = s.drained_checkpoint()
    print(f"[fault] {fault}: pool wrong {sorted(truth.wrong_blocks)}; "
          f"{[(lk.cause.value, lk.path.value, lk.request_id) for lk in report.leaks]}")
    assert report.verdict is Verdict.LEAK, report.explanation
    assert leaked_ids(report) == truth.wrong_blocks
    assert report.leaked_blocks == len(truth.wrong_blocks)
    assert {lk.cause for lk in report.leaks} == {cause}, report.explanation
    if path is not None:
        assert {lk.path for lk in report.leaks} == {path}
    if victim is not None:
        assert {lk.request_id for lk in report.leaks} == {victim}
    if cause is LeakCause.ORPHAN:  # outside every table: no request's, vLLM agrees
        assert not truth.wrong_blocks & {b for ids in truth.tables.values() for b in ids}
    if cause is LeakCause.DOUBLE_FREE:
        assert truth.negative == truth.wrong_blocks  # ref_cnt -1 in vLLM's pool
    else:
        assert truth.referenced == truth.wrong_blocks and not truth.negative


def test_without_a_fault_armed_the_chaos_scheduler_is_vllms(sched: Callable[..., Sched]) -> None:
    """The same drivers on the unarmed chaos scheduler leave vLLM's pool idle, and kvguard
    reports no leak: what the fault tests catch is the fault."""
    for fault, (drive, build, _, _) in FAULTS.items():
        if fault is Fault.PREEMPTION_SKIPS_FREE:
            continue  # its driver reads the fault's victim
        s = sched(**{"num_blocks": 64, **build}, max_num_seqs=4,
                  scheduler_cls=ChaosScheduler, env={"KVGUARD_ONLINE_AUDIT": "0"})
        drive(s)
        s.run_to_completion()
        assert not s.pool_truth().wrong_blocks, fault
        assert s.drained_checkpoint().verdict is not Verdict.LEAK, fault
