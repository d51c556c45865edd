"""``read_pool`` on vLLM's real ``BlockPool``: the counts it gives the audit are vLLM's own.

The reader makes two passes (every ``ref_cnt``, then the ref counts of the cached blocks)
and hands the reconciler a column that reads a block's prefix hash only when asked. The
ground truth is vLLM's free queue itself (``get_all_free_blocks``: which blocks are free,
and which of those still carry a prefix hash, i.e. are evictable cache) and its ref counts,
never kvguard's reader; and the same audit with every hash read into a list and the free
queue walked block by block must say the same.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.types import AcquireKind, FinishReason, LeakCause, RequestId
from kvguard.vllm_plugin.pool_reader import BlockHashes, read_pool

NUM_BLOCKS = 2_000


def _pool() -> Any:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=NUM_BLOCKS + 1, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    kvm = KVCacheManager(cfg, max_model_len=1 << 16, scheduler_block_size=16,
                         hash_block_size=16, enable_caching=True)
    return kvm.block_pool


def _cache(pool: Any, blocks: list[Any], first: int) -> None:
    for i, b in enumerate(blocks, start=first):
        key = make_block_hash_with_group_id(BlockHash(i.to_bytes(8, "little")), 0)
        pool._insert_block_hash(key, b, None)


def _scenario(pool: Any, *, live: bool) -> tuple[OwnershipLedger, list[int]]:
    """600 cached blocks freed (evictable), 100 of them hit again by a live request when
    ``live``; 400 blocks of 50 live requests (when ``live``); 3 blocks a finished request
    never gave back. Returns the ledger and the leaked block ids."""
    ledger = OwnershipLedger(null_block_ids=(pool.null_block.block_id,))
    cached = pool.get_new_blocks(600)
    _cache(pool, cached, 0)
    pool.free_blocks(cached)
    if live:
        hit = RequestId("hit-0000abcd")
        ledger.on_request_admitted(hit, 0.0)
        pool.touch(cached[:100])
        ledger.on_blocks_acquired(hit, [b.block_id for b in cached[:100]],
                                  AcquireKind.PREFIX_HIT)
        active = pool.get_new_blocks(400)
        _cache(pool, active[:200], 10_000)  # full blocks of running requests
        for r in range(50):
            rid = RequestId(f"live-{r}-0000abcd")
            ledger.on_request_admitted(rid, 0.0)
            ledger.on_blocks_acquired(rid, [b.block_id for b in active[8 * r:8 * r + 8]],
                                      AcquireKind.ALLOCATE)
    leaked = pool.get_new_blocks(3)
    rid = RequestId("leaky-0000abcd")
    ledger.on_request_admitted(rid, 0.0)
    ledger.on_blocks_acquired(rid, [b.block_id for b in leaked], AcquireKind.ALLOCATE)
    ledger.on_request_finished(rid, FinishReason.ABORTED, 1.0)
    ledger.on_request_freed(rid, 1.0)
    return ledger, [b.block_id for b in leaked]


def _check(live: bool) -> None:
    pool = _pool()
    ledger, leaked = _scenario(pool, live=live)
    opts = ReconcileOptions(now=100.0)
    snap = read_pool(pool)
    assert isinstance(snap.cached, BlockHashes)  # no list of hashes was built
    rec = reconcile(snap, ledger, opts)

    # vLLM's own view: its free queue, and the prefix hashes of the blocks in it.
    free = pool.free_block_queue.get_all_free_blocks()
    evictable = sum(1 for b in free if b.block_hash is not None)
    referenced = sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
    assert (rec.states.cached, rec.states.free) == (evictable, len(free) - evictable)
    assert rec.states.active == referenced - len(leaked)
    assert rec.states.held_by_finished == len(leaked)
    assert [(f.cause, f.block_ids) for f in rec.findings] == [
        (LeakCause.FINISHED_REQUEST, leaked)]

    walked = reconcile(read_pool(pool, walk_free_queue=True), ledger, opts)
    assert walked.states == rec.states
    assert [(f.cause, f.block_ids) for f in walked.findings] == [
        (f.cause, f.block_ids) for f in rec.findings]


def test_a_drained_pool_is_counted_as_vllm_counts_it() -> None:
    _check(live=False)


def test_a_busy_pool_with_prefix_hits_is_counted_as_vllm_counts_it() -> None:
    _check(live=True)
