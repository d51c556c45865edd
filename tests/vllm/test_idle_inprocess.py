"""An idle in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) judged without a step.

Nothing steps an in-process engine while its caller does not, and it has no thread of its
own: its thread is the caller's. kvguard judges a drain a legitimate hold blocked (and a
checkpoint asked for) when the caller says the engine is idle (``run_idle_checks``, on its
own thread) or at the next admission. Truth: vLLM's own block pool (ref counts of the
request's blocks), never kvguard's counters. The server's twin (a real busy loop woken
through its input queue) is ``tests/observability/test_idle_engine.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest

from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.core.types import LeakCause, LeakPath, Verdict
from kvguard.transport.control import write_request
from kvguard.vllm_plugin.idle import run_idle_checks
from kvguard.vllm_plugin.pool_reader import request_block_ids

BOUND_SECONDS = 1.0

pytestmark = pytest.mark.kv_connector


def test_an_idle_in_process_engine_is_judged_by_run_idle_checks_and_at_the_next_admission(
    engines: Callable[..., Harness],
) -> None:
    h = engines(kv_transfer_config={
        "kv_connector": "DelayedFreeConnector",
        "kv_connector_module_path": "kvguard.chaos.delay_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"complete_after_steps": 0,
                                      "never_complete_request_prefixes": ["never-"]},
    })
    g = h.guard
    g.config = dataclasses.replace(g.config, delayed_free_bound_seconds=BOUND_SECONDS)
    assert g.idle_waker is None  # no busy loop in-process: nothing may run off its thread
    rid = h.add(prompt(700, 70), max_tokens=5, rid="never-1")
    h.run_to_completion()  # the caller stops stepping here: the engine is idle
    internal = h.internal_id(rid)
    held = request_block_ids(h.scheduler.kv_cache_manager, internal)
    assert len(held) >= 3 and all(h.pool.blocks[b].ref_cnt > 0 for b in held)  # vLLM's pool
    before = len(g.reports)
    assert run_idle_checks(h.engine)  # within the bound: nothing to judge yet
    assert len(g.reports) == before and g.drain_held_until is not None
    time.sleep(max(0.0, g.drain_held_until - time.time()) + 0.05)
    assert run_idle_checks(h.engine)  # no step, no request
    r = g.reports[-1]
    assert r.drained and r.verdict is Verdict.LEAK, r.explanation
    [leak] = r.leaks
    assert (leak.cause, leak.path) == (LeakCause.FINISHED_REQUEST, LeakPath.DELAYED_FREE)
    assert leak.client_request_id == "never-1" and sorted(leak.block_ids) == sorted(held)
    truth = h.pool_truth()
    assert truth.referenced == frozenset(held)  # vLLM holds exactly what kvguard names

    # A checkpoint asked for through the request file (the sidecar's POST), then idle.
    n = len(g.reports)
    time.sleep(0.01)  # a newer mtime than the file the guard saw at start (none)
    write_request(g.config.run_dir, g.engine)
    assert run_idle_checks(h.engine)
    assert len(g.reports) == n + 1 and g.reports[-1].drained
    assert g.reports[-1].leaked_blocks == len(held)

    # A second hold past its bound with no idle call: the next admission judges it first.
    rid2 = h.add(prompt(710, 70), max_tokens=5, rid="never-2")
    h.run_to_completion()
    held2 = request_block_ids(h.scheduler.kv_cache_manager, h.internal_id(rid2))
    assert held2 and g.drain_held_until is not None
    time.sleep(max(0.0, g.drain_held_until - time.time()) + 0.05)
    n = len(g.reports)
    h.add(prompt(720, 40), max_tokens=2)  # admission: audited before the request enters
    assert len(g.reports) == n + 1
    r = g.reports[-1]
    assert r.drained and r.verdict is Verdict.LEAK
    assert {f.client_request_id for f in r.leaks} == {"never-1", "never-2"}
    assert r.leaked_blocks == len(set(held) | set(held2))
    h.run_to_completion()
    assert g.errors.total == 0
