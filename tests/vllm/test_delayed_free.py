"""Delayed frees through vLLM's real KV-connector interface (the DelayedFreeConnector)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvguard.chaos.delay_connector import DelayedFreeConnector
from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.core.types import LeakCause, LeakPath, Verdict
from kvguard.vllm_plugin.pool_reader import request_block_ids

BOUND_SECONDS = 0.5

pytestmark = pytest.mark.kv_connector


def _engine(engines: Callable[..., Harness]) -> Harness:
    h = engines(kv_transfer_config={
        "kv_connector": "DelayedFreeConnector",
        "kv_connector_module_path": "kvguard.chaos.delay_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"complete_after_steps": 3,
                                      "never_complete_request_prefixes": ["never-"]},
    })
    h.guard.config = dataclasses.replace(h.guard.config, delayed_free_bound_seconds=BOUND_SECONDS)
    return h


def _step_until(h: Harness, cond: Callable[[], bool], seconds: float = 120.0) -> None:
    """Step (10 ms apart: holds are timed) until ``cond()``; a generous deadline for a
    loaded host, the condition decides."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        h.engine.step()
        time.sleep(0.01)


def test_delayed_free_within_bound_is_not_a_leak(engines: Callable[..., Harness]) -> None:
    h = _engine(engines)
    rid = h.add(prompt(800, 70), max_tokens=5)
    h.run_to_completion()
    # The connector still "transfers": the finished request holds its blocks.
    internal = h.internal_id(rid)
    assert request_block_ids(h.scheduler.kv_cache_manager, internal)
    assert not any(r.verdict is Verdict.LEAK for r in h.reports())
    _step_until(h, lambda: not h.scheduler.requests)
    r = h.latest()
    assert r.verdict in (Verdict.CLEAN, Verdict.SATURATED), r.explanation
    # One delayed free each way: this request's (the warm-up's came before).
    assert h.events()["delayed_free_begin"] == 1
    assert h.events()["delayed_free_end"] == 1


def test_transfer_that_never_completes_is_a_delayed_free_leak_until_it_does(
    engines: Callable[..., Harness],
) -> None:
    h = _engine(engines)
    rid = h.add(prompt(900, 70), max_tokens=5, rid="never-1")
    h.run_to_completion()
    internal = h.internal_id(rid)
    held = len(request_block_ids(h.scheduler.kv_cache_manager, internal))
    assert held >= 3

    def leak_reported() -> Any:
        r = h.latest_drained()
        return r is not None and r.verdict is Verdict.LEAK

    _step_until(h, leak_reported)
    r = h.latest()
    assert r.drained
    [leak] = r.leaks
    assert leak.cause is LeakCause.FINISHED_REQUEST and leak.path is LeakPath.DELAYED_FREE
    assert leak.request_id == internal and leak.client_request_id == "never-1"
    assert leak.blocks == held and r.pool is not None and r.pool.held_by_finished == held
    assert leak.held_for_seconds is not None and leak.held_for_seconds >= BOUND_SECONDS
    assert "delayed free" in r.explanation

    DelayedFreeConnector.release_all()  # the completion finally arrives
    _step_until(h, lambda: not h.scheduler.requests)
    r = h.latest()
    assert r.verdict in (Verdict.CLEAN, Verdict.SATURATED), r.explanation
    assert r.pool is not None and r.pool.held_by_finished == 0


def test_a_failure_at_a_delayed_free_completion_is_counted_and_vllm_frees_anyway(
    engines: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The completion frees the blocks through ``_free_blocks`` with no finish around it: the
    ``_free_request_blocks`` hook claims the request's table there (its only kvguard work
    on vLLM's own paths). A failure in it is counted under that hook and vLLM's free goes
    on: the request leaves vLLM and its blocks are back in vLLM's free count."""
    h = _engine(engines)
    free_before = h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    rid = h.add(prompt(1000, 70), max_tokens=5)
    h.run_to_completion()
    internal = h.internal_id(rid)
    assert request_block_ids(h.scheduler.kv_cache_manager, internal)  # held for the transfer
    errors_before = dict(h.guard.errors.by_hook)

    def claim(request_id: str) -> None:
        raise RuntimeError("injected failure in kvguard's claim")
    monkeypatch.setattr(h.guard, "claim", claim)
    _step_until(h, lambda: not h.scheduler.requests)
    monkeypatch.undo()

    new = {k: n - errors_before.get(k, 0) for k, n in h.guard.errors.by_hook.items()}
    assert {k: n for k, n in new.items() if n} == {"free_request_blocks": 1}
    assert internal not in h.scheduler.requests
    assert not request_block_ids(h.scheduler.kv_cache_manager, internal)
    assert h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
