"""The pace of drained audits on a real vLLM engine (``KVGUARD_CHECKPOINT_MIN_INTERVAL_SECONDS``).

A drain the pace lets go leaves a leak unaudited; the audit the next admission takes
(before the request enters, the pool still as the drain left it) names it, scored
against vLLM's own pool and block tables, in sync and async scheduling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from _modes import in_mode

from kvguard.chaos.faults import SCHEDULER_CLS, Fault, FaultPlan
from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.core.types import LeakCause, LeakPath, Verdict
from kvguard.testing.scheduling import Scheduling
from kvguard.vllm_plugin.pool_reader import request_block_ids

Engines = Callable[..., Harness]


@pytest.fixture(params=list(Scheduling), ids=str)
def engines(request: pytest.FixtureRequest, engines: Engines) -> Engines:
    return in_mode(engines, request.param)


def test_a_drain_the_pace_let_go_is_audited_before_the_next_request_enters(
        engines: Engines) -> None:
    h = engines(scheduler_cls=SCHEDULER_CLS)
    g = h.guard
    assert g.config.checkpoint_min_interval_seconds == 0  # the default: every drain
    g.config = dataclasses.replace(g.config, checkpoint_min_interval_seconds=3600.0,
                                   checkpoint_burst=1)
    h.add(prompt(700, 40), max_tokens=8)
    h.run_to_completion()
    h.drain_scheduler()  # async scheduling: the last batch ends a step later
    first = h.latest()
    assert first.drained and first.verdict is not Verdict.LEAK, first.explanation

    h.chaos.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
    victim = h.add(prompt(701, 70), max_tokens=50)
    h.step_until(lambda: len(request_block_ids(h.scheduler.kv_cache_manager,
                                               h.internal_id(victim))) >= 3)
    internal = h.internal_id(victim)
    h.engine.abort_request([victim])
    h.run_to_completion()
    h.drain_scheduler()
    truth = h.pool_truth()  # vLLM's own pool: the victim's blocks are still referenced
    assert truth.referenced and not h.scheduler.running and not h.scheduler.waiting
    assert h.latest() is first  # drained, but the pace let it go
    state = g.state()
    assert state.unaudited_drain_at is not None and state.drains_unaudited_total >= 1

    g.config = dataclasses.replace(g.config, checkpoint_min_interval_seconds=1e-6)
    nxt = h.add(prompt(702, 40), max_tokens=4)
    r = h.latest()
    assert r.checkpoint_id > first.checkpoint_id and r.drained
    assert r.verdict is Verdict.LEAK, r.explanation
    [leak] = r.leaks
    assert (leak.cause, leak.path, leak.request_id) == (
        LeakCause.FINISHED_REQUEST, LeakPath.ABORT, internal)
    assert set(leak.block_ids) == set(truth.referenced)
    assert r.pool.active == 0  # taken before the new request entered
    assert g.state().unaudited_drain_at is None
    h.run_to_completion()  # the engine goes on: the new request finishes
    assert h.vllm_status(nxt) is not None


def test_an_audit_failing_at_admission_is_counted_and_the_request_still_runs(
        engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    h = engines()
    g = h.guard
    g.config = dataclasses.replace(g.config, checkpoint_min_interval_seconds=3600.0,
                                   checkpoint_burst=1)
    for seed in (710, 711):  # the second drain finds no token: owed
        h.add(prompt(seed, 40), max_tokens=4)
        h.run_to_completion()
        h.drain_scheduler()
    assert g.pacer.owed_since is not None
    g.config = dataclasses.replace(g.config, checkpoint_min_interval_seconds=1e-6)

    def broken(**_: object) -> None:
        raise RuntimeError("audit broke")

    monkeypatch.setattr(g, "checkpoint_now", broken)
    generated = h.vllm_metric("vllm:generation_tokens")
    h.add(prompt(712, 40), max_tokens=4)
    assert g.errors.by_hook["checkpoint"] == 1
    h.run_to_completion()
    h.drain_scheduler()
    # vLLM's own counters and pool: the request ran to its end and gave its blocks back.
    assert h.vllm_metric("vllm:generation_tokens") - generated == 4
    assert not h.pool_truth().referenced
    monkeypatch.undo()
    g.request_checkpoint()
    g.on_step_end()
    r = h.latest()
    # No hook event was lost: the next audit judges (not "records incomplete").
    assert r.drained and r.verdict in (Verdict.CLEAN, Verdict.SATURATED), r.explanation
