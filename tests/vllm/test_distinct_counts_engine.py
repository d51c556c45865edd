"""Distinct leaked blocks on a real engine (issue 13.1): requests that shared a prefix leak it once.

Three aborted requests share a two-block prefix through vLLM's prefix cache and
all keep their blocks (the free on their abort path is skipped). vLLM's own pool
is the ground truth: the blocks with a reference at idle, and its
``get_usage()`` (what ``vllm:kv_cache_usage_perc`` exports) times the usable
blocks. The report's ``leaked_blocks``, its per-cause count, the pool states
and the sidecar's ``kvguard_leaked_blocks`` must all equal it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvguard.chaos.faults import SCHEDULER_CLS, Fault, FaultPlan
from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.core.types import LeakCause, Verdict
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore
from kvguard.vllm_plugin.pool_reader import request_block_ids

PREFIX = prompt(7000, 64)  # two full 32-token blocks, cached after the first request


def _leaked_metric(text: str, engine: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvguard_leaked_blocks":
            for s in fam.samples:
                if s.labels["engine_name"] == engine:
                    out[s.labels["cause"]] = out.get(s.labels["cause"], 0.0) + s.value
    return out


def test_prefix_shared_leaks_count_each_block_once_against_vllms_pool(
    engines: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGUARD_RUN_DIR", str(tmp_path))
    h = engines(scheduler_cls=SCHEDULER_CLS)
    h.guard.config = dataclasses.replace(h.guard.config, publish_interval_seconds=0.0)
    h.add(PREFIX + prompt(7001, 40), max_tokens=4)  # long first request; caches the prefix
    h.run_to_completion()
    victims = [h.add(PREFIX + prompt(7010 + i, 40), max_tokens=60) for i in range(3)]
    kvm = h.scheduler.kv_cache_manager
    h.step_until(lambda: len(h.scheduler.running) == 3 and all(
        len(request_block_ids(kvm, r.request_id)) >= 4 for r in h.scheduler.running))
    tables = {v: request_block_ids(kvm, h.internal_id(v)) for v in victims}
    shared = set.intersection(*(set(t) for t in tables.values()))
    assert len(shared) >= 2, f"the victims must really share the cached prefix: {tables}"
    h.chaos.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 3}))  # below kvguard, in vLLM's path
    h.abort(*victims)
    h.run_to_completion()
    r = h.latest()

    # Ground truth from vLLM: the blocks that still have a reference at idle.
    held = {b.block_id for b in h.pool.blocks if b.ref_cnt > 0 and not b.is_null}
    usable = h.pool.num_gpu_blocks - 1
    assert round(h.pool.get_usage() * usable) == len(held)
    assert held == {b for t in tables.values() for b in t}

    assert r.verdict is Verdict.LEAK and r.drained
    assert r.leaked_blocks == len(held)
    assert r.leaked_blocks_by_cause[LeakCause.FINISHED_REQUEST] == len(held)
    assert r.pool is not None and r.pool.held_by_finished == len(held)
    assert {b for lk in r.leaks for b in lk.block_ids} == held
    # Each finding keeps its own count and says how much of it the others hold too.
    for lk in r.leaks:
        assert lk.client_request_id is not None
        assert lk.blocks == len(set(tables[lk.client_request_id]))
        assert lk.shared_blocks == len(shared)
    assert sum(lk.blocks for lk in r.leaks) > len(held)  # the old, over-counted figure
    assert r.explanation.startswith(f"{len(held)} block(s) leaked in 3 finding(s).")

    assert h.guard.publisher.flush(30.0)  # the state with this report is on disk
    with TestClient(create_app(EngineStore(tmp_path), poll_interval_seconds=0.05)) as c:
        metrics = _leaked_metric(c.get("/metrics").text, h.guard.engine)
    assert metrics.get("finished_request") == float(len(held))
    assert sum(metrics.values()) == float(len(held))
