"""Engine states as an engine would publish them, for sidecar tests without an engine.

Every report here is judged by kvguard's own code: a reference pool
(``tests/core/_pool.py``) is driven into the requested state, the ledger is fed the
events vLLM's hooks would produce, and ``kvguard.core`` reconciles the snapshot and
builds the report. The verdict, the block counts, the leak rows and the explanation
therefore come from the code under test; the factory decides only what happened in
the pool (which requests finished cleanly, which aborts skipped their free). Tests
compare what the sidecar shows with that ground truth (:class:`Judged`).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from _pool import Harness, Leak, build_report

from kvguard.core.report import CheckpointReport
from kvguard.core.types import FinishReason
from kvguard.transport.publisher import state_path
from kvguard.transport.state import EngineState

BLOCKS_PER_LEAK = 2
"""Blocks each leaked request holds (an abort whose free was skipped)."""
LAST_LEAK_HELD_FOR_SECONDS = 1.0
"""How long before the checkpoint the last leaked request finished (each earlier one 3 s
more: admitting, allocating and aborting a request take one harness tick each)."""
_TICKS_PER_LEAK = 3


@dataclass(frozen=True)
class Judged:
    """A report kvguard's reconciler wrote, with the reference pool's ground truth."""

    report: CheckpointReport
    leaks: list[Leak]
    """The requests whose free was skipped, in the order they finished."""
    harness: Harness

    def held_for_seconds(self, leak: Leak) -> float:
        """Seconds from ``leak``'s finish to the checkpoint, by the harness clock."""
        return self.report.taken_at - leak.finished_at


def judged(cid: int, *, engine: str = "dp0", epoch: str = "e1", holding: int = 0,
           cached: int = 10, capacity: int = 63, taken_at: float | None = None) -> Judged:
    """Drive a ``capacity``-block reference pool to a drained checkpoint and judge it.

    ``cached`` blocks are left by requests that finished cleanly with full (hashed)
    blocks; ``holding`` requests then take ``BLOCKS_PER_LEAK`` fresh blocks each and
    are aborted with their free skipped (vllm #29987). The checkpoint is taken at
    ``taken_at`` (default: ``100 - cid`` seconds ago), by the same clock.
    """
    taken = taken_at if taken_at is not None else time.time() - 100 + cid
    h = Harness(capacity + 1, clock_start=taken - 3600.0)
    left = cached
    while left:
        req = h.admit()
        n = min(left, 8)
        h.allocate(req, n, hash_mask=[True] * n, attributed=True)
        h.finish(req, FinishReason.STOPPED, attributed=True)
        left -= n
    h.tick(max(0.0, taken - h.t - _TICKS_PER_LEAK * holding - LAST_LEAK_HELD_FOR_SECONDS))
    for _ in range(holding):
        req = h.admit()
        h.allocate(req, BLOCKS_PER_LEAK, hash_mask=[False] * BLOCKS_PER_LEAK, attributed=True)
        h.skip_free_on_abort(req)
    h.tick(max(0.0, taken - h.t))
    rec = h.reconcile()
    r = build_report(rec, checkpoint_id=cid, taken_at=h.t, engine=engine, epoch=epoch)
    return Judged(report=r, leaks=list(h.leaks), harness=h)


def report(cid: int, *, engine: str = "dp0", epoch: str = "e1", holding: int = 0,
           cached: int = 10, capacity: int = 63,
           taken_at: float | None = None) -> CheckpointReport:
    """The report of :func:`judged` alone."""
    return judged(cid, engine=engine, epoch=epoch, holding=holding, cached=cached,
                  capacity=capacity, taken_at=taken_at).report


def state(reports: list[CheckpointReport], *, engine: str = "dp0", epoch: str = "e1",
          updated_at: float | None = None, hook_errors: int = 0,
          model_name: str | None = "tiny-llama", engine_index: int = 0) -> EngineState:
    """The engine's published state after ``reports`` (its last is the latest checkpoint)."""
    last = reports[-1] if reports else None
    return EngineState(
        kvguard_version="0.1.0", engine=engine, epoch=epoch, pid=1234, started_at=1.0,
        updated_at=updated_at if updated_at is not None else time.time(),
        engine_kind="vllm", engine_version="0.32.0", model_name=model_name,
        engine_index=engine_index, pool=last.pool if last else None,
        finished_requests_holding_blocks=last.finished_requests_holding_blocks if last else 0,
        events_total={"admit": 10, "finish": 10}, hook_errors_total=hook_errors,
        checkpoints_total=dict(Counter(r.verdict.value for r in reports)), reports=reports)


def write(run_dir: Path, s: EngineState) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    p = state_path(run_dir, s.engine)
    p.write_text(s.model_dump_json())
    return p
