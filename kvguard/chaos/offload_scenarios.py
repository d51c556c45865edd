"""Chaos scenarios on vLLM's real OffloadingConnector (CPU build, torch-CPU worker).

Each engine runs vLLM's OffloadingConnector, scheduler side and ``CPUOffloadingManager``
included, with :class:`~kvguard.testing.offload_spec.TorchCpuOffloadingSpec` as its spec.
The truth is vLLM's: its metrics (``vllm:external_prefix_cache_hits``,
``vllm:kv_offload_load_bytes``, ``vllm:kv_offload_store_bytes``,
``vllm:num_preemptions``), its scheduler (request status, queues,
``has_pending_push_work``) and its connector's job table; the reloaded KV is compared
byte for byte with what the model computed. A driver raises ``NotExercised`` when vLLM
did not take the path.

Pool: 16 blocks of 32 tokens (15 usable), so that six 150-token requests evict a
170-token prefix from the prefix cache and a later request must load it from the tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvguard.chaos.expect import NotExercised
from kvguard.chaos.harness import EngineHarness, prompt
from kvguard.testing.offload_spec import offload_transfer_config
from kvguard.testing.offload_worker import TorchCpuOffloadingWorker, live_workers

__all__ = ["OFFLOAD_ENGINE", "TIER_OF_3_CHUNKS", "drive_abort_during_load", "drive_load_lost",
           "drive_preemption_with_stores", "drive_reload_after_eviction",
           "drive_reset_with_stores_in_flight", "drive_store_lost", "drive_tier_full",
           "offload_engine"]

PREFIX_TOKENS = 170
"""The shared prompt: 5 full blocks (160 tokens) are stored, then loaded back."""
FULL_BLOCKS = PREFIX_TOKENS // 32

OFFLOAD_ENGINE: dict[str, object] = {"num_gpu_blocks_override": 16, "max_model_len": 256}


def offload_engine(cpu_bytes_to_use: int = 8 << 20, **faults: object) -> dict[str, object]:
    """Engine overrides: the small pool and the OffloadingConnector with ``faults``."""
    extra = {f"kvguard_{k}": v for k, v in faults.items()}
    return {**OFFLOAD_ENGINE, "extra": {"kv_transfer_config": offload_transfer_config(
        cpu_bytes_to_use, **extra)}}


TIER_OF_3_CHUNKS = 3 * 16384
"""A tier of 3 chunks for the tiny model (2 layers x 8,192 B per block, bf16)."""


def worker_of(h: EngineHarness) -> TorchCpuOffloadingWorker:
    """This engine's offload worker (in-process engines: the newest in this process)."""
    workers = live_workers()
    if not workers:
        raise NotExercised("no torch-CPU offload worker was built: is the engine running "
                             "the OffloadingConnector with TorchCpuOffloadingSpec?")
    return workers[-1]


def connector_scheduler(h: EngineHarness) -> Any:
    return h.scheduler.connector.connector_scheduler


def _pages(w: TorchCpuOffloadingWorker, blocks: list[int]) -> list[torch.Tensor]:
    return [w.device[t][b].clone() for b in blocks for t in range(len(w.device))]


def _blocks(h: EngineHarness, client_id: str) -> list[int]:
    groups = h.scheduler.kv_cache_manager.get_block_ids(h.internal_id(client_id))
    return [int(b) for g in groups for b in g]


def _evict_prefix(h: EngineHarness, seed: int) -> None:
    """Six other 150-token prompts: the pool's LRU evicts the prefix's blocks."""
    for i in range(6):
        h.add(prompt(seed + i, 150), max_tokens=4)
    h.run_to_completion()


def _store_prefix(h: EngineHarness, rid: str, seed: int) -> list[torch.Tensor]:
    """Run ``rid`` (the shared prefix) and return its full blocks' pages as computed."""
    h.add(prompt(seed, PREFIX_TOKENS), max_tokens=8, rid=rid)
    h.step_until(lambda: rid_computed(h, rid) >= PREFIX_TOKENS)
    pages = _pages(worker_of(h), _blocks(h, rid)[:FULL_BLOCKS])
    h.run_to_completion()
    return pages


def rid_computed(h: EngineHarness, client_id: str) -> int:
    try:
        return int(h.scheduler.requests[h.internal_id(client_id)].num_computed_tokens)
    except KeyError:
        return 0


def _settle_jobs(h: EngineHarness) -> None:
    """Step until the connector has no job in flight (healthy workers only)."""
    h.step_until(lambda: not connector_scheduler(h)._jobs, max_steps=200)


def drive_reload_after_eviction(h: EngineHarness) -> str:
    """Store a prefix, evict it from the pool, reload it: vLLM counts external hits and
    load bytes, and the reloaded pages equal the computed ones byte for byte."""
    computed = _store_prefix(h, "prefix-a", 4500)
    _settle_jobs(h)
    stored = h.vllm_metric("vllm:kv_offload_store_bytes")
    _evict_prefix(h, 4600)
    hits0 = h.vllm_metric("vllm:external_prefix_cache_hits")
    load0 = h.vllm_metric("vllm:kv_offload_load_bytes")
    h.add(prompt(4500, PREFIX_TOKENS), max_tokens=8, rid="prefix-b")
    h.step_until(lambda: rid_computed(h, "prefix-b") >= PREFIX_TOKENS)
    reloaded = _pages(worker_of(h), _blocks(h, "prefix-b")[:FULL_BLOCKS])
    h.run_to_completion()
    _settle_jobs(h)
    h.drain_scheduler()
    hits = h.vllm_metric("vllm:external_prefix_cache_hits") - hits0
    loaded = h.vllm_metric("vllm:kv_offload_load_bytes") - load0
    if stored <= 0 or hits <= 0 or loaded <= 0:
        raise NotExercised(f"vLLM stored {stored:g} B, then counted {hits:g} external "
                             f"prefix hits and {loaded:g} B loaded")
    differ = sum(1 for a, b in zip(computed, reloaded, strict=True) if not torch.equal(a, b))
    if differ:
        raise AssertionError(f"{differ} of {len(computed)} reloaded KV pages differ from "
                             "the computed ones (a store copied a re-used block?)")
    return (f"{hits:g} external prefix-hit tokens, {loaded:g} B loaded, "
            f"{len(computed)} pages byte-identical")


def drive_abort_during_load(h: EngineHarness) -> str:
    """Abort a request while its load is in flight (jobs take 4 steps): vLLM keeps it
    FINISHED_ABORTED with its blocks until the load completes, then frees them."""
    _store_prefix(h, "prefix-a", 4700)
    _settle_jobs(h)
    _evict_prefix(h, 4800)
    h.add(prompt(4700, PREFIX_TOKENS), max_tokens=8, rid="loading")
    h.step_until(lambda: _status(h, "loading") == "WAITING_FOR_REMOTE_KVS", max_steps=20)
    h.abort("loading")
    h.step()
    status, held = _status(h, "loading"), h.blocks_of("loading")
    if status != "FINISHED_ABORTED" or held == 0:
        raise NotExercised(f"after the abort vLLM has the request {status} with {held} "
                             "blocks (expected FINISHED_ABORTED, holding its blocks)")
    h.drain_scheduler()
    _settle_jobs(h)
    return f"aborted during its load: held {held} blocks as FINISHED_ABORTED, then freed"


def _status(h: EngineHarness, client_id: str) -> str | None:
    try:
        return str(h.scheduler.requests[h.internal_id(client_id)].status.name)
    except KeyError:
        return None


def drive_reset_with_stores_in_flight(h: EngineHarness) -> str:
    """``reset_prefix_cache(reset_connector=True)`` while store jobs are in flight (jobs
    take 6 steps): vLLM forgets the jobs and empties the tier; their late completions are
    skipped as stale; the engine then offloads and drains as usual."""
    cs = connector_scheduler(h)
    h.add(prompt(4900, PREFIX_TOKENS), max_tokens=2, rid="stored")
    h.run_to_completion()
    in_flight = len(cs._jobs)
    if not in_flight:
        raise NotExercised("no store job was in flight at the reset")
    if not h.engine.reset_prefix_cache(reset_connector=True):
        raise NotExercised("vLLM refused reset_prefix_cache")
    if cs._jobs or cs.manager._num_allocated_chunks - len(cs.manager._free_list):
        raise NotExercised("the reset left jobs or tier chunks behind")
    h.add(prompt(4901, PREFIX_TOKENS), max_tokens=4)
    h.run_to_completion()
    _settle_jobs(h)
    h.drain_scheduler()
    return f"reset with {in_flight} store job(s) in flight"


def drive_preemption_with_stores(h: EngineHarness) -> str:
    """Long requests in a 15-block pool with stores 3 steps long: preemptions flush the
    preempted requests' stores (vLLM's ``jobs_to_flush``)."""
    fenced0 = worker_of(h).fenced_jobs
    for i in range(4):
        h.add(prompt(5000 + i, 60), max_tokens=150)
    h.run_to_completion()
    _settle_jobs(h)
    h.drain_scheduler()
    n = int(h.vllm_metric("vllm:num_preemptions"))
    stored = h.vllm_metric("vllm:kv_offload_store_bytes")
    fenced = worker_of(h).fenced_jobs - fenced0
    if n == 0 or stored <= 0 or fenced == 0:
        raise NotExercised(f"{n} preemptions, {stored:g} B stored, {fenced} store jobs "
                             "fenced in flight")
    return f"{n} preemptions, {fenced} store jobs fenced in flight, {stored:g} B stored"


def drive_tier_full(h: EngineHarness) -> str:
    """A 3-chunk tier and a 5-chunk prefix: vLLM's ``prepare_store`` returns None ("cannot
    store chunks", ``vllm:kv_offload_allocation_failure``); nothing is stuck or leaks."""
    cs = connector_scheduler(h)
    capacity = int(cs.manager._num_chunks)
    fail0 = h.vllm_metric("vllm:kv_offload_allocation_failure")
    h.add(prompt(5500, PREFIX_TOKENS), max_tokens=4, rid="too-big")
    h.run_to_completion()
    _settle_jobs(h)
    h.drain_scheduler()
    failures = h.vllm_metric("vllm:kv_offload_allocation_failure") - fail0
    if capacity >= FULL_BLOCKS or failures <= 0:
        raise NotExercised(f"a {capacity}-chunk tier, {failures:g} allocation failures")
    return f"{failures:g} allocation failures on a {capacity}-chunk tier"


def drive_load_lost(h: EngineHarness) -> str:
    """The load completion of ``lost-load`` never arrives; the client aborts it: vLLM
    keeps it FINISHED_ABORTED with its blocks for ever."""
    _store_prefix(h, "prefix-a", 5100)
    _settle_jobs(h)
    _evict_prefix(h, 5200)
    worker_of(h).arm_loss(loads=1)
    h.add(prompt(5100, PREFIX_TOKENS), max_tokens=8, rid="lost-load")
    h.step_until(lambda: _status(h, "lost-load") == "WAITING_FOR_REMOTE_KVS", max_steps=20)
    h.step(3)
    h.abort("lost-load")
    # Two detections on two clocks: the pool audit's (from the finish) and the offload
    # audit's (from when kvguard first saw the job, at its poll's resolution).
    h.step_until(lambda: _leak_reported(h) and _stuck(h), max_steps=10**6,
                 pause_seconds=0.005, max_seconds=h.guard.delayed_free_bound + 20)
    status = _status(h, "lost-load")
    if status != "FINISHED_ABORTED":
        raise NotExercised(f"vLLM has the request {status}, expected FINISHED_ABORTED")
    return f"lost-load holds {h.blocks_of('lost-load')} blocks as FINISHED_ABORTED"


def drive_store_lost(h: EngineHarness) -> str:
    """The store completion of ``lost-store``'s prefix never arrives: no pool block leaks,
    the engine never goes idle, and ``waits`` (same prefix) waits for ever."""
    worker_of(h).arm_loss(stores=1)
    h.add(prompt(5300, PREFIX_TOKENS), max_tokens=4, rid="lost-store")
    h.run_to_completion()
    _evict_prefix(h, 5400)  # re-allocates the fenced blocks: each flushes the lost job
    # Not drain_scheduler(): with async scheduling the engine keeps a (empty) batch in
    # flight for the pending job, so it never drains.
    h.step_until(lambda: not h.scheduler.requests)
    h.add(prompt(5300, PREFIX_TOKENS), max_tokens=4, rid="waits")
    bound = h.guard.offload.bound_seconds if h.guard.offload is not None else 0.0
    h.step_until(lambda: _stuck_with_waiters(h),
                 max_steps=10**6, pause_seconds=0.005, max_seconds=bound + 20)
    cs = connector_scheduler(h)
    waiting = [r.request_id for r in h.scheduler.waiting]
    pool_free = h.pool.get_num_free_blocks()
    if not (h.scheduler.has_requests() and cs.has_pending_push_work()
            and waiting == [h.internal_id("waits")] and rid_computed(h, "waits") == 0
            and h.blocks_of("waits") == 0 and pool_free == h.num_usable()):
        raise NotExercised(f"vLLM: pending push work {cs.has_pending_push_work()}, "
                             f"waiting {waiting}, {pool_free}/{h.num_usable()} blocks free")
    return (f"store job lost: engine never idle (has_pending_push_work), 'waits' queued "
            f"with 0 blocks, pool {pool_free}/{h.num_usable()} free")


def _leak_reported(h: EngineHarness) -> bool:
    report = h.latest_drained()
    return report is not None and report.verdict.value == "leak"


def _stuck(h: EngineHarness) -> bool:
    audit = h.guard.offload
    last = audit.last if audit is not None else None
    return last is not None and last.stuck_jobs > 0


def _stuck_with_waiters(h: EngineHarness) -> bool:
    audit = h.guard.offload
    return _stuck(h) and audit is not None and audit.last is not None \
        and bool(audit.last.waiting)


Driver = Callable[[EngineHarness], str]
