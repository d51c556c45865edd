"""Opt-in reclaim on this vLLM's real scheduler, sync and async, vLLM's own pool as the truth.

For each leak class the chaos scheduler injects that reclaim can fix (an abort whose free
is skipped, vllm #29987; a deferred free whose fence never comes, vllm #46283's class), a
wedge is named, reclaim frees through vLLM's own path, and right after it vLLM's pool (free
count, every block's ``ref_cnt``, the free queue's order, the prefix-cache hashes) equals
what the same schedule leaves on a clean scheduler whose free was not skipped; the starved
request is admitted at the next step and the pool drains idle. Busy pools (live long
requests, a burst, preemption) get 0 wedge verdicts and 0 reclaims, and over random
schedules reclaim never frees a reference a live request's table holds.

Timing: the wedge thresholds are 0 s and ``AFTER_STEPS`` steps; the wedge monitor judges
at most every ``JUDGE_INTERVAL_SECONDS`` (0.5 s), so three consecutive verdicts take about
1 s of stepping (``PAUSE`` between steps keeps the step count small).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from _sched import Sched, pool_is_idle, prompt
from hypothesis import HealthCheck, example, given, settings, target
from hypothesis import strategies as st

from kvguard.chaos.faults import Fault, FaultPlan
from kvguard.chaos.faults.scheduler import AsyncChaosScheduler, ChaosScheduler
from kvguard.core.monitors.reclaim import ReclaimWatch
from kvguard.core.reclaim import RefusalReason
from kvguard.core.wedge import DeadOwnerKind

BLOCK = 16
AFTER_STEPS = 5
AFTER_VERDICTS = 3
PAUSE = 0.005
RECLAIM = {"KVGUARD_RECLAIM": "1", "KVGUARD_RECLAIM_AFTER_VERDICTS": str(AFTER_VERDICTS),
           "KVGUARD_WEDGE_AFTER_SECONDS": "0", "KVGUARD_WEDGE_AFTER_STEPS": str(AFTER_STEPS),
           "KVGUARD_DELAYED_FREE_BOUND_SECONDS": "0.05", "KVGUARD_ONLINE_AUDIT": "0"}
SCHEDULERS = {"sync": ChaosScheduler, "async": AsyncChaosScheduler}


def _reclaim(s: Sched) -> ReclaimWatch:
    r = s.guard.reclaim
    assert r is not None, "KVGUARD_RECLAIM=1 did not attach the reclaim monitor"
    return r


def _step_paced(s: Sched, until: Callable[[], bool], max_steps: int = 5000) -> None:
    """Step with ``PAUSE`` between steps (the wedge judges in wall time) until ``until()``."""
    for _ in range(max_steps):
        s.step()
        if until():
            return
        time.sleep(PAUSE)
    raise AssertionError(f"condition not reached in {max_steps} paced steps")


def pool_state(pool: Any) -> dict[str, Any]:
    """vLLM's pool as vLLM holds it: free count, every block's ref count, the free queue in
    order, and each cached block's hash (null block aside)."""
    return {"free": pool.get_num_free_blocks(),
            "ref_cnt": {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null},
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "hashes": {b.block_id: b.block_hash for b in pool.blocks
                       if not b.is_null and b.block_hash is not None},
            "hash_map_size": len(pool.cached_block_hash_to_block)}


def _skip_free_on_abort(s: Sched, *, faulty: bool) -> str:
    """A request of 10+ blocks aborted mid-decode; ``faulty``: its free is skipped."""
    victim = s.add(prompt(3, 10 * BLOCK), 100, rid="victim")
    s.step_until(lambda: len(s.table(victim)) >= 10)
    if faulty:
        s.scheduler.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
    s.abort(victim)
    s.step()
    return victim


def _deferred_never_released(s: Sched, *, faulty: bool) -> str:
    """A request of 10+ blocks finishes by length; ``faulty``: its free is parked in
    ``deferred_frees`` behind a fence that never comes."""
    if faulty:
        s.scheduler.arm(FaultPlan({Fault.DEFERRED_FREE_NEVER_RELEASED: 1}))
    victim = s.add(prompt(5, 10 * BLOCK), 8, rid="victim")
    s.step_until(lambda: s.scheduler.requests.get(victim) is None)
    if faulty:
        assert len(s.scheduler.deferred_frees) == 1, "vLLM did not park the free"
    return victim


LEAKS: dict[Fault, tuple[Callable[..., str], DeadOwnerKind, str]] = {
    Fault.SKIP_FREE_ON_ABORT: (_skip_free_on_abort, DeadOwnerKind.FINISHED_REQUEST,
                               "KVCacheManager.free"),
    Fault.DEFERRED_FREE_NEVER_RELEASED: (_deferred_never_released,
                                         DeadOwnerKind.FINISHED_REQUEST,
                                         "Scheduler.deferred_frees"),
}


@pytest.mark.parametrize("mode", list(SCHEDULERS))
@pytest.mark.parametrize("fault", list(LEAKS), ids=str)
def test_reclaim_frees_a_wedged_pool_as_vllms_own_free_would_and_admits_the_starved(
        sched: Callable[..., Sched], fault: Fault, mode: str) -> None:
    drive, cause, path = LEAKS[fault]
    build = {"num_blocks": 16, "max_num_seqs": 4, "scheduler_cls": SCHEDULERS[mode]}
    # The clean run: the same schedule, no fault; the free happens where vLLM does it.
    clean = sched(env=RECLAIM, **build)
    drive(clean, faulty=False)
    clean_pool = pool_state(clean.pool)
    assert not clean.pool_truth().referenced

    s = sched(env=RECLAIM, **build)
    victim = drive(s, faulty=True)
    assert s.scheduler.faults.times_fired(fault) == 1, "vLLM did not take the fault's path"
    held = {b.block_id for b in s.pool.blocks if not b.is_null and b.ref_cnt > 0}
    assert len(held) >= 10
    starved = s.add(prompt(6, 6 * BLOCK), 4, rid="starved")
    wedge, reclaim = s.guard.wedge, _reclaim(s)
    assert wedge is not None
    for _ in range(5000):
        s.step()
        if reclaim.reclaims_total:
            break
        assert s.pool_truth().tables.get(starved) is None, "admitted before any reclaim"
        time.sleep(PAUSE)
    assert reclaim.reclaims_total == 1, reclaim.state()
    assert wedge.verdicts_total == 1
    # Right after the reclaim, before the next step: vLLM's pool is the clean run's.
    assert pool_state(s.pool) == clean_pool
    [entry] = reclaim.state().recent
    assert (entry.reclaimed, entry.cause, entry.request_id, entry.path) == \
        (True, cause, victim, path)
    assert set(entry.block_ids) == held and entry.blocks == len(held)
    assert reclaim.state().reclaimed_blocks_total == {cause.value: len(held)}
    assert s.guard.errors.total == 0, dict(s.guard.errors.by_hook)
    # The starved request is admitted at the next step, and runs to its end.
    s.step()
    assert len(s.table(starved)) >= 6 and s.status(starved) == "RUNNING"
    s.run_to_completion()
    assert s.status(starved) == "FINISHED_LENGTH_CAPPED"
    assert not pool_is_idle(s.pool_truth(), s.pool)
    assert not wedge.wedged and wedge.verdicts_total == 1
    assert s.drained_checkpoint().leaks == []


DELAYING = {"kv_connector": "DelayedFreeConnector",
            "kv_connector_module_path": "kvguard.chaos.delay_connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"complete_after_steps": 2,
                                          "never_complete_request_prefixes": ["never-"]}}
"""A real KV connector whose transfers for ``never-*`` requests never complete."""


def test_a_delayed_free_whose_completion_never_came_is_freed_and_a_late_one_dropped(
        sched: Callable[..., Sched]) -> None:
    """vLLM keeps a finished request whose connector delayed its free (vllm #46283): reclaim
    frees it through ``Scheduler._free_blocks``, as the completion would have; a completion
    that arrives after that is dropped before vLLM sees it (vLLM asserts its request)."""
    from vllm.v1.outputs import KVConnectorOutput

    clean = sched(env=RECLAIM, num_blocks=16, max_num_seqs=4)
    clean.add(prompt(5, 10 * BLOCK), 8, rid="never-1")
    clean.run_to_completion()
    clean_pool = pool_state(clean.pool)

    s = sched(env=RECLAIM, num_blocks=16, max_num_seqs=4, kv_transfer_config=DELAYING)
    victim = s.add(prompt(5, 10 * BLOCK), 8, rid="never-1")
    s.step_until(lambda: s.requests[victim].is_finished())
    assert victim in s.scheduler.requests, "vLLM did not keep the request (no delayed free)"
    held = set(s.table(victim))
    s.add(prompt(6, 6 * BLOCK), 4, rid="starved")
    reclaim = _reclaim(s)
    _step_paced(s, lambda: reclaim.reclaims_total > 0)
    assert victim not in s.scheduler.requests
    assert pool_state(s.pool) == clean_pool
    [entry] = reclaim.state().recent
    assert (entry.cause, entry.path, entry.request_id, set(entry.block_ids)) == \
        (DeadOwnerKind.DELAYED_FREE, "Scheduler._free_blocks", victim, held)
    s.step(kv_connector_output=KVConnectorOutput(finished_sending={victim}))
    assert s.guard.reclaimed_requests == set() and s.guard.errors.total == 0
    assert len(s.table("starved")) >= 6
    s.step_until(lambda: s.requests["starved"].is_finished())  # its own free is delayed too
    assert s.status("starved") == "FINISHED_LENGTH_CAPPED"


def _busy_long(s: Sched) -> None:
    s.add(prompt(1, 10 * BLOCK), 60, rid="long")
    s.step_until(lambda: len(s.table("long")) >= 10)
    s.add(prompt(2, 6 * BLOCK), 4, rid="behind")
    while s.status("long") == "RUNNING":
        s.step()
        time.sleep(PAUSE / 5)
    s.run_to_completion()


def _burst(s: Sched) -> None:
    for i in range(24):
        s.add(prompt(40 + i, 3 * BLOCK + i), 20)
    s.run_to_completion()


def _preemption(s: Sched) -> None:
    for i in range(4):
        s.add(prompt(10 + i, 60), 150)
    s.run_to_completion()
    assert s.preemptions > 0, "vLLM preempted nothing"


@pytest.mark.parametrize("mode", list(SCHEDULERS))
@pytest.mark.parametrize("load", [_busy_long, _burst, _preemption],
                         ids=["live_long_requests", "burst", "preemption"])
def test_a_busy_pool_is_never_wedged_nor_reclaimed(
        sched: Callable[..., Sched], load: Callable[[Sched], None], mode: str) -> None:
    s = sched(env=RECLAIM, num_blocks=16, max_num_seqs=4, scheduler_cls=SCHEDULERS[mode])
    judged = []
    wedge = s.guard.wedge
    assert wedge is not None
    orig = wedge.on_step_end

    def counting(*a: Any, **k: Any) -> Any:
        out = orig(*a, **k)
        if wedge.last is not None and wedge.last.waiting_requests:
            judged.append(wedge.last.wedged)
        return out

    wedge.on_step_end = counting  # type: ignore[method-assign]
    load(s)
    assert judged, "nothing waited long enough to be judged"
    assert not any(judged) and wedge.verdicts_total == 0
    r = _reclaim(s).state()
    assert (r.reclaims_total, r.refused_total, r.recent) == (0, {}, [])
    assert not pool_is_idle(s.pool_truth(), s.pool)


def test_an_orphan_is_reported_never_reclaimed(sched: Callable[..., Sched]) -> None:
    """A reference taken behind every hook (the chaos suite's ref-count bump) wedges the
    pool; no owner is known, so reclaim refuses it (``owner_unknown``) and frees nothing."""
    env = {**RECLAIM, "KVGUARD_ONLINE_AUDIT": "1", "KVGUARD_ONLINE_BUDGET_FRACTION": "0.5"}
    s = sched(env=env, num_blocks=4, max_num_seqs=2, scheduler_cls=ChaosScheduler)
    s.scheduler.arm(FaultPlan({Fault.REFCOUNT_BUMP: 1}))
    s.add(prompt(7, 2 * BLOCK + 3), 4)
    s.run_to_completion()
    bumped = {b.block_id for b in s.pool.blocks if not b.is_null and b.ref_cnt > 0}
    assert len(bumped) == 1
    s.add(prompt(8, 3 * BLOCK), 4, rid="starved")
    reclaim = _reclaim(s)
    _step_paced(s, lambda: bool(reclaim.refused))
    state = reclaim.state()
    assert state.refused_total == {RefusalReason.OWNER_UNKNOWN.value: 1}, state
    assert state.reclaims_total == 0 and state.reclaimed_blocks_total == {}
    assert [(e.cause, e.reclaimed, set(e.block_ids)) for e in state.recent] == \
        [(DeadOwnerKind.ORPHAN, False, bumped)]
    assert {b.block_id for b in s.pool.blocks if not b.is_null and b.ref_cnt > 0} == bumped
    assert s.guard.wedge is not None and s.guard.wedge.wedged


def test_a_vllm_without_the_free_path_refuses_and_counts(
        sched: Callable[..., Sched], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``KVCacheManager.free`` is missing (a vLLM nobody tested), the reclaim is
    refused as ``no_free_path``, naming the touch point, and the engine goes on."""
    s = sched(env=RECLAIM, num_blocks=16, max_num_seqs=4, scheduler_cls=ChaosScheduler)
    _skip_free_on_abort(s, faulty=True)
    kvm = s.scheduler.kv_cache_manager
    monkeypatch.setattr(type(kvm), "free", property(lambda self: None))
    s.add(prompt(6, 6 * BLOCK), 4, rid="starved")
    reclaim = _reclaim(s)
    _step_paced(s, lambda: bool(reclaim.refused))
    [entry] = reclaim.state().recent
    assert (entry.reclaimed, entry.refused) == (False, RefusalReason.NO_FREE_PATH)
    assert "KVCacheManager.free" in entry.detail
    assert reclaim.state().refused_total == {"no_free_path": 1}
    s.step(), s.step()
    assert s.pool_truth().tables.get("starved") is None and s.guard.errors.total == 0


# ---------------------------------------------------------------- property
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 7), st.integers(1, 40)),
    st.tuples(st.just("abort"), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("step"), st.integers(1, 6), st.just(False))), min_size=4, max_size=30)


WEDGING: list[tuple[str, int, Any]] = [("add", 7, 40), ("step", 3, False), ("abort", 0, True),
                                      ("add", 7, 40), ("add", 6, 30), ("step", 6, False)]
"""A schedule that leaks and then wedges the pool (one reclaim at least, checked)."""


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(ops=WEDGING)
@given(ops=OPS)
def test_reclaim_never_frees_a_reference_a_live_request_holds(
        sched: Callable[..., Sched], ops: list[tuple[str, int, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Random schedules (prefix-sharing prompts, aborts with and without a skipped free,
    steps) with the wedge judged at every step and reclaim after one verdict: at every
    reclaim, each block in a live request's table keeps at least the references the live
    tables hold, and stays out of the free queue."""
    import kvguard.core.wedge_monitor as wm

    monkeypatch.setattr(wm, "JUDGE_INTERVAL_SECONDS", 0.0)
    env = {**RECLAIM, "KVGUARD_RECLAIM_AFTER_VERDICTS": "1", "KVGUARD_WEDGE_AFTER_STEPS": "1"}
    s = sched(env=env, num_blocks=12, max_num_seqs=3, scheduler_cls=ChaosScheduler)
    reclaim = _reclaim(s)
    checked = [0]
    inner = reclaim.reclaimer

    class Checked:
        def reclaim(self, owner: Any) -> Any:
            out = inner.reclaim(owner)
            live: dict[int, int] = {}
            for rid, ids in s.pool_truth().tables.items():
                req = s.scheduler.requests.get(rid)
                if req is not None and not req.is_finished():
                    for b in ids:
                        live[b] = live.get(b, 0) + 1
            free = {b.block_id for b in s.pool.free_block_queue.get_all_free_blocks()}
            for b, n in live.items():
                assert s.pool.blocks[b].ref_cnt >= n and b not in free, (b, owner, out)
            checked[0] += 1
            return out

    reclaim.reclaimer = Checked()
    n = 0
    for op, a, b in ops:
        if op == "add":
            n += 1
            shared = prompt(900 + a % 3, BLOCK * 2)
            s.add(shared + prompt(n, b), a * 5)
        elif op == "abort":
            live = [r for r, q in s.requests.items() if not q.is_finished()]
            if live:
                if b:
                    s.scheduler.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
                s.abort(live[a % len(live)])
        else:
            for _ in range(a):
                s.step()
    s.step_until(lambda: not s.scheduler.has_unfinished_requests(), max_steps=3000)
    assert s.guard.errors.total == 0, dict(s.guard.errors.by_hook)
    target(float(checked[0]))
    if ops == WEDGING:
        assert checked[0] >= 1, "the wedging schedule reclaimed nothing: the property is empty"
