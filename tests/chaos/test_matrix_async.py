"""The chaos matrix with vLLM's async scheduling: the same verdicts as the sync matrix.

The scenarios whose engine path async scheduling changes (see ``ASYNC_PATHS``) run
again on an engine that really schedules asynchronously
(``AsyncScheduler``, a batch queue of 2; checked from vLLM's EngineCore and recorded in
each result), on the chaos scheduler's async twin. Each run is held to the scenario's
one expectation, the same one tests/chaos/test_matrix.py holds the sync run to, and
scored against vLLM's own pool; so a pass in both files is the same verdict, cause, path
and named requests in both modes. ``--scheduling both`` compares the two runs itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.chaos.result import ScenarioResult, Status, mode_disagreements, verdict_key
from kvguard.chaos.scenarios import matrix
from kvguard.testing.scheduling import Scheduling

ASYNC_PATHS = (
    # a request ending while the batch scheduled with it is still in flight
    "abort_final_step", "fault_skip_free_on_abort",
    # preemption and speculative rollback with a batch scheduled ahead
    "preemption_storm", "fault_spec_rollback_keeps_blocks",
    # delayed and deferred frees (async parks frees behind the step fence)
    "fault_transfer_never_completes", "fault_deferred_free_never_released",
    # the records-then-resync path under a batch queue
    "hook_exceptions",
    # vLLM's real OffloadingConnector: loads and stores in flight across a batch queue,
    # fences flushed by preemption, a lost store that keeps an (empty) batch in flight
    "offload_abort_during_load", "offload_preemption_stores", "fault_offload_load_lost",
    "fault_offload_store_lost",
)
"""What CI runs in async mode (11 of 29). Double frees, skipped frees, ref-count bumps,
preemption and aborts in flight also run in async mode in the checkpoint and online-audit
engine modules (tests/vllm/_modes.py); the rest of the matrix runs no path that depends on
step order (saturation, prefix hits, sliding windows). ``kvguard chaos --scheduling
async`` runs them all; last full run (before the offload scenarios): 22 passed,
``offload_connector`` then unsupported. The seven offload scenarios pass in both modes."""


def _chaos(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str],
                                                   list[ScenarioResult]]:
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvguard.cli.main", "chaos", "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--jobs", "2", *args],
        capture_output=True, text=True, timeout=3600, check=False)
    print(proc.stdout)
    return proc, [ScenarioResult.model_validate(r) for r in json.loads(out.read_text())]


@pytest.mark.timeout(2400)  # a fresh engine each
def test_the_async_sensitive_scenarios_give_the_same_verdict_with_async_scheduling(
        tmp_path: Path) -> None:
    names = {s.name for s in matrix()}
    assert set(ASYNC_PATHS) <= names, sorted(set(ASYNC_PATHS) - names)
    proc, results = _chaos(tmp_path, "--scheduling", "async", "--only", ",".join(ASYNC_PATHS))
    assert [r.name for r in results] == list(ASYNC_PATHS)  # in the order asked
    for r in results:
        assert r.scheduling is Scheduling.ASYNC
        assert r.status is Status.PASSED, f"{r.name}: {r.why}\n{proc.stdout}"
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.timeout(1200)
def test_both_modes_run_a_scenario_twice_labelled_and_compared(tmp_path: Path) -> None:
    proc, results = _chaos(tmp_path, "--scheduling", "both", "--only", "fault_refcount_bump")
    assert [r.scheduling for r in results] == [Scheduling.SYNC, Scheduling.ASYNC]
    assert all(r.status is Status.PASSED and r.leaks for r in results), proc.stdout
    assert verdict_key(results[0]) == verdict_key(results[1])
    assert not mode_disagreements(results) and proc.returncode == 0
    assert "fault_refcount_bump  sync" in proc.stdout
    assert "fault_refcount_bump  async" in proc.stdout


def test_a_verdict_that_differs_between_modes_is_reported() -> None:
    base = ScenarioResult(name="s", injected="", expected="", concluded="clean",
                          status=Status.PASSED)
    other = base.model_copy(update={"scheduling": Scheduling.ASYNC, "concluded": "leak",
                                    "status": Status.FAILED})
    assert mode_disagreements([base, base.model_copy(
        update={"scheduling": Scheduling.ASYNC})]) == []
    assert mode_disagreements([base, other]) == [
        "s: sync clean (passed), async leak (failed)"]
