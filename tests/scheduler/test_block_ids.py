"""Which of vLLM's own ``KVCacheBlock`` objects a hook attributes to the engine's pool."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvguard.vllm_plugin.pool_reader import block_ids_in, counts_in


def _blocks(pool: object, other: object) -> list[Any]:
    null = KVCacheBlock(0, pool=pool)
    null.is_null = True
    return [KVCacheBlock(3, pool=pool), null, KVCacheBlock(5, pool=other),
            KVCacheBlock(7), KVCacheBlock(2, pool=pool)]


def test_only_the_pools_own_non_null_blocks_count_in_block_order() -> None:
    pool, other = object(), object()
    blocks = _blocks(pool, other)
    # Block 7 has no pool set (a block made outside a BlockPool): the engine's one pool.
    assert block_ids_in(blocks, pool) == [3, 7, 2]
    assert block_ids_in(tuple(blocks), other) == [5, 7]
    assert block_ids_in(blocks, pool) == [b.block_id for b in blocks if counts_in(b, pool)]
    assert block_ids_in([], pool) == []


def test_blocks_without_a_pool_slot_older_vllm_take_the_per_block_rule() -> None:
    pool = object()
    old = [SimpleNamespace(block_id=4, is_null=False), SimpleNamespace(block_id=0, is_null=True),
           SimpleNamespace(block_id=6)]
    assert block_ids_in(old, pool) == [4, 6]
