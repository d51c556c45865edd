"""kvguard attaches to this vLLM's real scheduler through its entry point, every hook on."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import vllm
from _sched import Sched, prompt

from kvguard.chaos.faults.scheduler import ChaosScheduler
from kvguard.vllm_plugin.hooks import (
    COORDINATOR_HOOKS,
    POOL_HOOKS,
    SCHEDULER_HOOKS,
    skips_blocks,
)


@pytest.mark.parametrize("cls", ["Scheduler", "ChaosScheduler"])
def test_every_hook_kvguard_expects_is_installed(sched: Callable[..., Sched], cls: str) -> None:
    s = sched(**({"scheduler_cls": ChaosScheduler} if cls == "ChaosScheduler" else {}))
    assert type(s.scheduler).__name__ == cls
    assert s.guard.hooks_missing == []
    coordinator = s.scheduler.kv_cache_manager.coordinator
    # One full-attention group frees nothing before a request ends: no window hook.
    assert not skips_blocks(coordinator)
    assert sorted(s.guard.hooks_installed) == sorted(
        [f"BlockPool.{m}" for m in POOL_HOOKS] + [f"{cls}.{m}" for m in SCHEDULER_HOOKS])
    # Installed on vLLM's own objects, the ones vLLM calls.
    for m in SCHEDULER_HOOKS:
        assert getattr(getattr(s.scheduler, m), "__kvguard_hook__", False), m
    for m in POOL_HOOKS:
        assert getattr(getattr(s.pool, m), "__kvguard_hook__", False), m
    for m in COORDINATOR_HOOKS:
        assert not getattr(getattr(coordinator, m), "__kvguard_hook__", False), m


def test_the_published_state_names_this_vllm(sched: Callable[..., Sched]) -> None:
    s = sched()
    assert s.guard.state().engine_version == vllm.__version__


def test_hooks_see_vllms_calls(sched: Callable[..., Sched]) -> None:
    """Every lifecycle hook fires on vLLM's own paths (admit, preempt, finish, abort, free)."""
    s = sched(num_blocks=24)  # 23 usable blocks: four 100-token requests must preempt
    rids = [s.add(prompt(i, 100), 120) for i in range(4)]
    s.step()
    s.abort(rids[3])
    s.run_to_completion()
    assert s.preemptions > 0, "vLLM preempted nothing: the pool is not small enough"
    events = s.guard.ledger.num_events
    assert events["admit"] == 4, events
    assert events["preempt"] == s.preemptions, events
    assert events["finish"] == 4 and events["free"] == 4, events
    assert events["finish_aborted"] == 1 and events["finish_length"] == 3, events
    assert [s.status(r) for r in rids] == ["FINISHED_LENGTH_CAPPED"] * 3 + ["FINISHED_ABORTED"]
    assert s.guard.errors.total == 0, s.guard.errors.by_hook


def test_the_cost_meter_meters_whole_windows_on_this_vllm(sched: Callable[..., Sched]) -> None:
    """kvguard's live cost meter on this vLLM's scheduler: a window of 8 steps in every 16
    is metered, with vLLM's own methods called through it (the engine's work is the same
    with the metered hooks: every request finishes, the pool is idle again)."""
    s = sched(env={"KVGUARD_COST_SAMPLE_EVERY_STEPS": "16"}, num_blocks=24)
    rids = [s.add(prompt(i, 100), 120) for i in range(4)]
    steps = s.run_to_completion()
    m = s.guard.meter
    assert m.every == 16 and m.window == 8
    assert m.steps_total >= 8 * (steps // 16 - 1), (m.steps_total, steps)
    assert 0 < m.self_ns_total < m.scheduler_ns_total
    assert m.windows_skipped_total == 0
    assert [s.status(r) for r in rids] == ["FINISHED_LENGTH_CAPPED"] * 4
    assert s.preemptions > 0  # the preemption path ran, metered or not
    assert s.guard.errors.total == 0, s.guard.errors.by_hook
    cost = s.guard.state().cost
    assert cost is not None and cost.sampled_steps_total == m.steps_total
