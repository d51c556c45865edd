"""kvguard's offload audit on vLLM's real OffloadingConnector scheduler side, 0.32-0.34.

No model and no worker: vLLM's ``Scheduler`` with the OffloadingConnector (its scheduler
side and ``CPUOffloadingManager``) is stepped by hand, and the test plays the worker: it
reports the store jobs vLLM hands out (``kv_connector_metadata.store_jobs``) as completed
in ``kv_connector_output.kv_connector_worker_meta``, or withholds them (a lost
completion). vLLM's own job table and manager are the truth.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from _sched import Sched, build_scheduler, prompt
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput

from kvguard.core.offload import OffloadVerdict
from kvguard.testing.offload_spec import offload_transfer_config
from kvguard.vllm_plugin.versions import model_runner_output


def _step(h: Sched, complete: bool, handed: set[int]) -> None:
    """One step; the worker reports every store job handed out so far when ``complete``."""
    s = h.scheduler
    out = s.schedule()
    meta = out.kv_connector_metadata
    handed.update(getattr(meta, "store_jobs", {}) or {})
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[] if s.requests[r].num_computed_tokens < s.requests[r].num_tokens else [120]
               for r in req_ids]
    done = {j: 1 for j in handed} if complete else {}
    if complete:
        handed.clear()
    kv_out = KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(
        completed_jobs=done)) if done else None
    s.update_from_output(out, model_runner_output(
        req_ids, sampled_token_ids=sampled, kv_connector_output=kv_out))


def test_a_store_withheld_is_stuck_then_reported_is_ok(tiny_model_dir: Path) -> None:
    sched = build_scheduler(tiny_model_dir, num_blocks=64, kv_transfer_config=(
        offload_transfer_config(1 << 20)))
    h = Sched(sched)
    audit = h.guard.offload
    assert audit is not None and h.guard.offload_source is not None
    h.guard.config = dataclasses.replace(h.guard.config, offload_job_bound_seconds=0.0)
    cs: Any = sched.connector.connector_scheduler
    handed: set[int] = set()
    h.add(prompt(1, 64), max_tokens=3, rid="stored")
    for _ in range(6):
        _step(h, False, handed)
        h.guard.poll_offload()
    # vLLM: the request finished, its store jobs are still in its books, the engine must
    # keep stepping, the manager's chunks are write-pending.
    assert "stored" not in sched.requests and cs._jobs and handed
    assert cs.has_pending_push_work() and sched.has_requests()
    pending = cs.manager._num_write_pending_chunks
    assert pending == sum(len(j.keys) for j in cs._jobs.values()) == 4
    state = audit.last
    assert state is not None and state.verdict is OffloadVerdict.STUCK
    assert {j.client_request_id for j in state.stuck} == {"stored"}
    assert state.tier is not None and state.tier.write_pending == pending
    # The worker reports them: vLLM completes the stores, kvguard says ok, the tier reconciles.
    _step(h, True, handed)
    assert not cs._jobs and not cs.has_pending_push_work()
    state = h.guard.poll_offload(drained_at=1.0)
    assert state is not None and state.verdict is OffloadVerdict.OK
    assert state.tier is not None and state.tier.write_pending == 0 and state.tier.ready == 4
    assert state.tier_mismatch is None and state.stuck_jobs_total >= 1
