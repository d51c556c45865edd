"""kvguard on vLLM's real OffloadingConnector (CPU build, torch-CPU offload worker).

Each case runs in its own process (``_offload_child.py``) on a fresh in-process engine:
vLLM keeps one worker-side KV connector per process. vLLM is the truth: its metrics
(``vllm:external_prefix_cache_hits``, ``vllm:kv_offload_store_bytes``), its scheduler and
its connector's job table; kvguard's offload audit and pool reports are checked against
them. The chaos matrix (tests/chaos/test_matrix*.py) scores the offload scenarios of
:mod:`kvguard.chaos.offload_scenarios`; these cases follow a fault past its detection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.kv_connector, pytest.mark.timeout(300)]

CHILD = Path(__file__).with_name("_offload_child.py")


def run_case(tmp_path: Path, case: str, scheduling: str = "sync",
             env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    run_dir = tmp_path / "run"
    env = {**os.environ, "KVGUARD_RUN_DIR": str(run_dir), "VLLM_PLUGINS": "kvguard",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env_extra or {})}
    proc = subprocess.run([sys.executable, str(CHILD), case, scheduling], capture_output=True,
                          text=True, env=env, timeout=280, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OFFLOAD-CASE ")),
                None)
    assert line is not None, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    assert out["scheduling"] == scheduling
    return out


def no_leak_reported(reports: list[dict[str, Any]]) -> None:
    assert reports, "kvguard took no checkpoint"
    assert all(not r["leaks"] for r in reports), [r["explanation"] for r in reports]
    assert all(r["verdict"] in ("clean", "saturated", "skipped") for r in reports)


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_lost_store_is_named_with_its_waiter_and_released_the_waiter_loads(
        tmp_path: Path, scheduling: str) -> None:
    out = run_case(tmp_path, "released", scheduling)
    # vLLM: the engine cannot go idle, the pool is all free, the waiter holds nothing.
    during = out["during"]
    assert during["pending_push_work"] and during["free"] == during["usable"]
    assert during["waits_computed"] == 0 and during["waits_blocks"] == 0
    # kvguard: the stuck store, its owner, its fenced blocks, the waiter.
    stuck = out["stuck"]
    assert stuck["verdict"] == "stuck" and stuck["stuck_jobs"] == 1
    (job,) = stuck["stuck"]
    assert job["kind"] == "store" and job["client_request_id"] == "lost-store"
    assert job["request_finished"] and job["chunks"] == 5 and job["fenced_blocks"] == 5
    assert [w["client_request_id"] for w in stuck["waiting"]] == ["waits"]
    assert stuck["tier"]["write_pending"] == 5
    # Released: vLLM loads the prefix for the waiter (160 tokens from the tier) ...
    assert out["released"] and out["hits_after_release"] == 160
    # ... and kvguard says ok again, its tier reconciled at the drain, the count kept.
    after = out["after"]
    assert after["verdict"] == "ok" and after["stuck_jobs_total"] == 1
    assert after["tier_checked_at"] is not None and after["tier_mismatch"] is None
    assert after["tier"]["write_pending"] == 0 and after["tier"]["read_pinned"] == 0
    assert out["published"]["stuck_jobs_total"] == 1  # in the state file readers get
    no_leak_reported(out["reports"])


def test_reset_prefix_cache_drops_a_stuck_store_and_kvguard_follows(tmp_path: Path) -> None:
    out = run_case(tmp_path, "reset")
    assert out["stuck"]["verdict"] == "stuck"
    assert out["reset_ok"] and out["vllm_after"] == {"jobs": 0, "pending_push_work": False}
    assert out["after_reset"]["verdict"] == "ok"
    assert out["after_reset"]["tier"]["write_pending"] == 0
    after = out["after"]
    assert after["verdict"] == "ok" and after["tier_mismatch"] is None
    assert after["tier_checked_at"] is not None
    no_leak_reported(out["reports"])


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_healthy_offload_workload_gives_no_false_finding(tmp_path: Path,
                                                           scheduling: str) -> None:
    out = run_case(tmp_path, "healthy", scheduling)
    assert out["hits"] > 0 and out["stored_bytes"] > 0
    # Every store the worker copied was reported to vLLM (no completion lost) ...
    assert out["stored_bytes"] == out["copied_bytes"]
    # ... and kvguard's tier counts are vLLM's manager's.
    after, tier = out["after"], out["vllm_tier"]
    assert after["verdict"] == "ok" and after["stuck_jobs_total"] == 0
    assert after["tier"]["capacity"] == tier["capacity"]
    assert after["tier"]["ready"] + after["tier"]["write_pending"] == tier["used"]
    assert after["tier"]["write_pending"] == tier["write_pending"] == 0
    assert after["tier_checked_at"] is not None and after["tier_mismatch"] is None
    no_leak_reported(out["reports"])


def test_lost_loads_wedge_the_engine_and_reclaim_refuses_to_free_what_a_load_may_write(
        tmp_path: Path) -> None:
    """Issue 54's lost offload load on the real connector: two requests aborted while their
    loads' completions never come hold 12 of 15 blocks; a 7-block request waits. The wedge
    is named with both, readiness is 503, and reclaim refuses both (``fenced``): vLLM does
    not fence a load's destination blocks, and a lost load's copy may still land in them,
    so freeing them could hand another request's KV to a late write. vLLM keeps every block
    as it was; only the connector (or a restart) can end the jobs."""
    out = run_case(tmp_path, "wedged_by_lost_loads", env_extra={
        "KVGUARD_WEDGE_AFTER_SECONDS": "1", "KVGUARD_WEDGE_AFTER_STEPS": "10",
        "KVGUARD_RECLAIM": "1", "KVGUARD_RECLAIM_AFTER_VERDICTS": "3"})
    before, after, v, r = out["before"], out["after"], out["verdict"], out["reclaim"]
    lost = {"lost-load-0", "lost-load-1"}
    # vLLM: both aborted requests keep their blocks, the starved one waits on the rest.
    assert set(before["status"].values()) == {"FINISHED_ABORTED"}
    held = sum(len(b) for b in before["blocks"].values())
    assert held == out["usable"] - before["free"] and before["free"] < 7
    # kvguard: wedged, named with both dead owners and exactly their blocks.
    assert v["wedged"] and v["waiting_requests"] == 1 and v["running_requests"] == 0
    assert {o["request_id"] for o in v["dead_owners"]} == lost
    assert v["dead_blocks"] == held
    assert out["ready"]["status"] == 503 and "lost-load" in out["ready"]["reason"]
    # reclaim: refused both, freed nothing; vLLM's pool is exactly as it was.
    assert r["refused_total"] == {"fenced": 2} and r["reclaims_total"] == 0, r
    assert after["status"] == before["status"] and after["blocks"] == before["blocks"]
    assert after["free"] == before["free"] and after["starved_waiting"]
    assert after["pending_loads"] == 2
