"""Faults injected in vLLM's own code paths: kvguard catches each from what vLLM does.

Each fault class runs on a fresh real engine built on the chaos scheduler (a vLLM
``Scheduler`` subclass; kvguard's hooks wrap its methods like any scheduler's). The
ground truth is read from vLLM's pool after the drain, never from kvguard: the leaked
block ids in kvguard's report must be exactly the pool's referenced blocks, and the
finding must carry the cause and path of the bug class.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.chaos.faults import Fault
from kvguard.chaos.harness import EngineHarness
from kvguard.chaos.result import Status
from kvguard.chaos.runner import build_for, fault_victims, scenarios_for, score, scored_report
from kvguard.chaos.scenarios import NotExercised
from kvguard.core.types import LeakCause, LeakPath

# fault scenario -> (cause, path or None when no hook can know it, names the victim)
NEW_FAULTS = {
    "fault_preemption_skips_free": (LeakCause.FINISHED_REQUEST, LeakPath.PREEMPTION, True),
    "fault_spec_rollback_keeps_blocks": (LeakCause.FINISHED_REQUEST, LeakPath.FINISH, True),
    "fault_prefix_hit_extra_ref": (LeakCause.ORPHAN, None, False),
    "fault_deferred_free_never_released": (LeakCause.FINISHED_REQUEST,
                                           LeakPath.DEFERRED_FREE, True),
    "fault_sliding_window_skips_free": (LeakCause.ORPHAN, None, False),
}


@pytest.fixture(scope="module")
def chaos_models(tmp_path_factory: pytest.TempPathFactory, run_dir: Path) -> Path:
    return tmp_path_factory.mktemp("chaos-models")


def test_kvguards_hooks_wrap_the_chaos_schedulers_own_methods(chaos_models: Path) -> None:
    model, scenarios = scenarios_for(chaos_models)
    h = build_for(scenarios["abort_final_step"], model)
    assert type(h.scheduler).__name__ == "ChaosScheduler"
    for name in ("_free_request", "_free_request_blocks", "_preempt_request"):
        assert f"ChaosScheduler.{name}" in h.guard.hooks_installed
        assert getattr(getattr(h.scheduler, name), "__kvguard_hook__", False)
    assert h.guard.state().faults_enabled == []  # nothing armed, nothing claimed


@pytest.mark.parametrize("name", sorted(NEW_FAULTS))
def test_each_fault_in_vllms_path_is_caught_with_the_pools_block_ids(
    name: str, chaos_models: Path,
) -> None:
    model, scenarios = scenarios_for(chaos_models)
    s = scenarios[name]
    h: EngineHarness = build_for(s, model)
    evidence = s.drive(h)
    report = scored_report(s, h)
    truth = h.pool_truth()
    print(f"[faults] {name}: {evidence}; pool leaked {sorted(truth.wrong_blocks)}")

    [fault] = s.faults
    assert h.chaos.faults.times_fired(fault) == 1
    # vLLM's own pool leaked, and kvguard names exactly those blocks.
    assert truth.wrong_blocks, "the fault left vLLM's pool clean"
    assert not truth.negative and not truth.unreachable
    reported = {b for lk in report.leaks for b in lk.block_ids}
    assert reported == truth.wrong_blocks
    assert round(truth.usage_blocks) == len(truth.referenced)  # vLLM's own usage agrees
    cause, path, names_victim = NEW_FAULTS[name]
    assert {lk.cause for lk in report.leaks} == {cause}, report.explanation
    if path is not None:
        assert {lk.path for lk in report.leaks} == {path}
    if names_victim:
        assert {lk.client_request_id for lk in report.leaks} == fault_victims(h)
    # A leak outside every table is no request's (vLLM's own tables agree).
    if cause is LeakCause.ORPHAN:
        in_tables = {b for ids in truth.tables.values() for b in ids}
        assert not truth.wrong_blocks & in_tables
    assert score(s, report, truth, fault_victims(h)) == (Status.PASSED, "")
    if fault is Fault.DEFERRED_FREE_NEVER_RELEASED:
        assert len(h.scheduler.deferred_frees) == 1  # still parked after the drain
    h.guard.close()


@pytest.mark.parametrize("name", ["abort_final_step", "abort_long_prefill"])
def test_a_scenario_whose_abort_never_reached_vllm_is_not_passed_as_clean(
    name: str, chaos_models: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lost abort leaves a clean pool: the scenario must say its path did not happen."""
    model, scenarios = scenarios_for(chaos_models)
    s = scenarios[name]
    h = build_for(s, model)
    monkeypatch.setattr(h, "abort", lambda *ids: None)  # the abort is lost on the way
    with pytest.raises(NotExercised, match="did not reach the engine"):
        s.drive(h)
    assert not h.pool_truth().wrong_blocks  # what a detector would have called "clean"
    h.guard.close()
