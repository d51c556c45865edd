"""Engine states as an engine would publish them, for sidecar tests without an engine."""

from __future__ import annotations

import time
from pathlib import Path

from kvguard.core.report import CheckpointReport, LeakReport, PoolReport
from kvguard.core.types import Evidence, FinishReason, LeakCause, LeakPath, Verdict
from kvguard.transport.publisher import state_path
from kvguard.transport.state import EngineState


def report(cid: int, *, engine: str = "dp0", epoch: str = "e1", holding: int = 0,
           cached: int = 10, capacity: int = 63, verdict: Verdict | None = None,
           taken_at: float | None = None) -> CheckpointReport:
    leaks = [LeakReport(request_id=f"r{i}-0000000{i % 10}", client_request_id=f"r{i}",
                        cause=LeakCause.FINISHED_REQUEST, finish_reason=FinishReason.ABORTED,
                        path=LeakPath.ABORT, blocks=2, held_for_seconds=1.0,
                        evidence=Evidence.DRAINED) for i in range(holding)]
    held = 2 * holding
    v = verdict or (Verdict.LEAK if holding else
                    Verdict.SATURATED if cached >= 0.8 * capacity else Verdict.CLEAN)
    return CheckpointReport(
        checkpoint_id=cid, engine=engine, epoch=epoch,
        taken_at=taken_at if taken_at is not None else time.time() - 100 + cid, drained=True,
        verdict=v,
        pool=PoolReport(capacity=capacity, free=capacity - cached - held, cached=cached,
                        active=0, held_by_finished=held, orphaned=0,
                        num_free_reported=capacity - held),
        saturation_ratio=cached / capacity, finished_requests_holding_blocks=holding,
        leaks=leaks, leaked_blocks_by_cause={LeakCause.FINISHED_REQUEST: held},
        explanation="test")


def state(reports: list[CheckpointReport], *, engine: str = "dp0", epoch: str = "e1",
          updated_at: float | None = None, hook_errors: int = 0) -> EngineState:
    last = reports[-1] if reports else None
    return EngineState(
        kvguard_version="0.1.0", engine=engine, epoch=epoch, pid=1234, started_at=1.0,
        updated_at=updated_at if updated_at is not None else time.time(),
        engine_kind="vllm", engine_version="0.32.0", pool=last.pool if last else None,
        finished_requests_holding_blocks=last.finished_requests_holding_blocks if last else 0,
        events_total={"admit": 10, "finish": 10}, hook_errors_total=hook_errors,
        checkpoints_total={r.verdict.value: 1 for r in reports}, reports=reports)


def write(run_dir: Path, s: EngineState) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    p = state_path(run_dir, s.engine)
    p.write_text(s.model_dump_json())
    return p
