"""Memory attribution on a real CPU vLLM engine (in-process, tiny dummy model).

A caller that keeps engine outputs (with a big CPU tensor each) in a list
grows process memory across drained checkpoints while the KV pool stays
clean: the attribution must name a live owner in process memory, not the KV
pool. A KV leak (injected) is the opposite: the pool moves, process memory
does not. And a failing attribution never breaks a checkpoint.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvguard.chaos.faults import SCHEDULER_CLS, Fault, FaultPlan
from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.core.report import AttributionStatus, Boundary, CheckpointReport, Verdict
from kvguard.sidecar.metrics import KvguardCollector
from kvguard.sidecar.store import EngineStore
from kvguard.transport.reader import read_run_dir
from kvguard.vllm_plugin.pool_reader import request_block_ids

Engines = Callable[..., Harness]
MiB = 1 << 20
PER_OUTPUT = 36 * MiB
"""Above glibc's largest mmap threshold (32 MiB): each kept tensor is fresh pages. Smaller
ones can land in heap the engine already freed but glibc kept resident, and then RSS does
not move (the evidence says so: "or freed heap the C allocator kept")."""
REQUESTS_PER_ROUND = 6


def _round(h: Harness, seed: int, keep: list[Any] | None = None) -> CheckpointReport:
    """Six short requests to completion, optionally keeping every finished output with a
    36 MiB CPU tensor (as a leaky caller would), then a declared checkpoint.

    The engine takes its own drained checkpoint inside the step that frees the last
    blocks, i.e. before that step's outputs reach the caller; the declared checkpoint
    after the round (what ``POST /v1/checkpoints`` asks for) sees what the caller kept.
    """
    before = len(h.guard.reports)
    for i in range(REQUESTS_PER_ROUND):
        h.add(prompt(seed * 100 + i, 40), max_tokens=8)
    while h.engine.has_unfinished_requests():
        for out in h.engine.step():
            if keep is not None and out.finished:
                keep.append((out, torch.ones(PER_OUTPUT // 4, dtype=torch.float32)))
    assert len(h.guard.reports) > before, "no drained checkpoint after the round"
    h.guard.request_checkpoint()
    report = h.guard.maybe_checkpoint()
    assert report is not None and report.drained, "the engine is idle: the checkpoint drains"
    return report


def _kv_storage_bytes(h: Harness) -> int:
    """The real KV tensors' backing storage, from the worker's model runner."""
    runner = h.engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in runner.kv_caches}
    return sum(storages.values())


def _boundaries(r: CheckpointReport) -> set[Boundary]:
    assert r.attribution is not None
    return {f.boundary for f in r.attribution.findings}


def test_retained_outputs_are_a_live_owner_in_process_memory_not_the_kv_pool(
        engines: Engines, run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGUARD_ATTRIBUTION_WARMUP_CHECKPOINTS", "1")
    monkeypatch.setenv("KVGUARD_ATTRIBUTION_MIN_BYTES", str(48 * MiB))
    monkeypatch.setenv("KVGUARD_SNAPSHOT_DIR", str(tmp_path / "snapshots"))
    h = engines()
    assert h.guard.attributor is not None

    base, quiet = _round(h, 1), _round(h, 2)
    # The checkpoint build_engine's warm-up request drained into was the attribution's
    # warm-up; the first round's own checkpoint is the baseline.
    assert [r.attribution.status for r in h.guard.reports if r.attribution] == [
        AttributionStatus.WARMING_UP, AttributionStatus.BASELINE, AttributionStatus.COMPARED,
        AttributionStatus.COMPARED, AttributionStatus.COMPARED]
    assert _boundaries(quiet) == set(), quiet.explanation

    a = base.attribution
    assert a is not None and a.scope is not None
    assert a.scope.domain == "cpu" and a.scope.world_size == 1
    assert a.scope.torch_version == torch.__version__
    assert a.kv_num_blocks == 64 and a.kv_bytes_per_block == 16 * 1024
    assert a.kv_pool_bytes == _kv_storage_bytes(h) == 1 * MiB
    assert base.host is not None and base.host.rss_bytes and base.host.swap_used_bytes is not None
    assert base.allocator is not None and base.allocator.allocated_bytes is None
    assert base.allocator.unavailable

    kept: list[Any] = []
    deltas = []
    for n in range(1, 4):
        r = _round(h, 10 + n, kept)
        retained = n * REQUESTS_PER_ROUND * PER_OUTPUT
        assert r.verdict in (Verdict.CLEAN, Verdict.SATURATED), r.explanation
        assert r.pool is not None and r.pool.held_by_finished == r.pool.orphaned == 0
        assert _boundaries(r) == {Boundary.PROCESS_MEMORY}, r.explanation
        assert r.attribution is not None
        (f,) = r.attribution.findings
        assert 0.85 * retained <= f.delta_bytes <= retained + 48 * MiB, (f.delta_bytes, retained)
        assert "not the KV pool" in f.evidence and "every block is accounted for" in f.evidence
        assert "live owner" in f.next_step
        assert r.attribution.snapshot_path is None
        assert (r.attribution.snapshot_note or "").startswith("unavailable: memory history "
                                                              "snapshots need CUDA")
        assert "process_memory" in r.explanation and "Memory attribution" in r.explanation
        deltas.append(f.delta_bytes)
    assert deltas == sorted(deltas), "growth across checkpoints must be monotonic"
    assert not (tmp_path / "snapshots").exists()

    # What the sidecar sees: the published state carries the sections, and the host
    # swap gauge is exported from it.
    (state,) = [st for st in read_run_dir(run_dir).states if st.engine == h.guard.engine]
    published = state.latest_report
    assert published is not None and published.attribution is not None
    assert {f.boundary for f in published.attribution.findings} == {Boundary.PROCESS_MEMORY}
    store = EngineStore(run_dir)
    store.refresh()
    names = {m.name: m for m in KvguardCollector(store).collect()}
    swap = names["kvguard_host_swap_used_bytes"].samples
    assert len(swap) == 1 and swap[0].value >= 0

    kept.clear()  # the owner lets go: the growth goes with it
    gc.collect()
    released = _round(h, 20)
    assert Boundary.PROCESS_MEMORY not in _boundaries(released), released.explanation


def test_a_kv_leak_moves_the_pool_not_process_memory(engines: Engines,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_ATTRIBUTION_WARMUP_CHECKPOINTS", "0")
    h = engines(scheduler_cls=SCHEDULER_CLS)
    _round(h, 30)  # build_engine's warm-up drained into the baseline checkpoint
    assert [r.attribution.status for r in h.guard.reports if r.attribution] == [
        AttributionStatus.BASELINE, AttributionStatus.COMPARED, AttributionStatus.COMPARED]

    h.chaos.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
    victim = h.add(prompt(31, 70), max_tokens=50)
    h.step_until(lambda: any(
        r.request_id.startswith(victim) and
        len(request_block_ids(h.scheduler.kv_cache_manager, r.request_id)) >= 3
        for r in h.scheduler.running))
    held = len(request_block_ids(h.scheduler.kv_cache_manager, h.internal_id(victim)))
    h.abort(victim)
    h.run_to_completion()
    r = h.latest()
    assert r.verdict is Verdict.LEAK
    assert _boundaries(r) == {Boundary.KV_POOL}, r.explanation
    assert r.attribution is not None
    (f,) = r.attribution.findings
    assert f.delta_bytes == held * 16 * 1024
    assert "only the ledger" in f.evidence and "block-reference transition" in f.next_step

    # A failing attribution never breaks the checkpoint: contained, counted, report out.
    class Broken:
        def checkpoint(self, checkpoint_id: int, pool: Any) -> Any:
            raise RuntimeError("probe exploded")

    h.guard.attributor = Broken()  # type: ignore[assignment]
    report = h.guard.checkpoint_now()
    assert report.verdict is Verdict.LEAK and report.attribution is None
    assert h.guard.errors.by_hook["attribution"] == 1
