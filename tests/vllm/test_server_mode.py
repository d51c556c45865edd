"""kvguard inside the real vLLM OpenAI server, where EngineCore is a separate process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvguard.core.types import Verdict
from kvguard.demo.run import wait_for_checkpoint
from kvguard.testing.engine import EngineSpec, ServerProcess
from kvguard.testing.scheduling import Scheduling
from kvguard.testing.tiny_model import make_tiny_model
from kvguard.testing.warmup import WARMUP_REQUESTS
from kvguard.testing.workload import run_workload

# vLLM's default scheduler class in each mode, as kvguard hooked it inside EngineCore: the
# server's own processes undid the CPU platform's override (async), or did not (sync).
SCHEDULER_CLASS = {Scheduling.SYNC: "Scheduler", Scheduling.ASYNC: "AsyncScheduler"}


@pytest.mark.parametrize("scheduling", list(Scheduling))
def test_server_with_plugin_publishes_a_report_and_disconnects_leave_no_leak(
    tmp_path: Path, scheduling: Scheduling,
) -> None:
    run_dir = tmp_path / "run"
    spec = EngineSpec(model_dir=make_tiny_model(tmp_path / "model"), max_num_seqs=8,
                      scheduling=scheduling)
    env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
           "KVGUARD_ENGINE_NAME": "demo"}
    with ServerProcess(spec, log_path=tmp_path / "server.log", env=env) as server:
        result = run_workload(server.base_url, spec.served_model_name,
                              shared_prefix_streams=6, disconnecting_streams=4)
        assert result.failed == 0 and result.completed >= 6
        # The drained checkpoint after the last request: the engine publishes it in the
        # same step as that request's free, so wait for all 10 frees, plus the warm-up
        # request's (a checkpoint from an earlier drain, between the two phases, must not
        # be taken for it).
        requests = 10 + WARMUP_REQUESTS
        state = wait_for_checkpoint(run_dir, after=time.time() - 5.0)
        deadline = time.monotonic() + 60
        while state.events_total.get("free", 0) < requests:
            assert time.monotonic() < deadline, state.events_total
            time.sleep(0.25)
            state = wait_for_checkpoint(run_dir, after=0.0)
        # The report came out of the EngineCore process, not this one.
        assert state.pid != server.pid
        assert f"{SCHEDULER_CLASS[scheduling]}.update_from_output" in state.hooks_installed
    report = state.latest_report
    assert report is not None
    assert report.verdict in (Verdict.CLEAN, Verdict.SATURATED), report.explanation
    assert report.leaks == [] and report.pool is not None
    assert report.pool.active == report.pool.held_by_finished == report.pool.orphaned == 0
    assert state.events_total["admit"] == requests and state.hook_errors_total == 0

    out = subprocess.run([sys.executable, "-m", "kvguard.cli.main", "report", "--json",
                          "--run-dir", str(run_dir)], capture_output=True, text=True, check=True)
    payload = json.loads(out.stdout)
    assert [p["engine"] for p in payload] == ["demo"]
    assert payload[0]["verdict"] == report.verdict.value
    text = subprocess.run([sys.executable, "-m", "kvguard.cli.main", "report",
                           "--run-dir", str(run_dir)], capture_output=True, text=True, check=True)
    assert f"verdict: {report.verdict.value.upper()}" in text.stdout
