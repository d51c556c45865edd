"""Read a vLLM ``BlockPool`` into an engine-agnostic ``PoolSnapshot``.

Reads ``KVCacheBlock.ref_cnt``, the prefix-cache hash and free-queue
membership of every block (a block is in vLLM's doubly linked free queue iff
its ``prev_free_block`` is set: the queue has sentinel head and tail blocks).
Must run on the engine's scheduler thread, between steps.
"""

from __future__ import annotations

from typing import Any

from kvguard.core.snapshot import PoolSnapshot


def read_pool(block_pool: Any) -> PoolSnapshot:
    blocks = block_pool.blocks
    refs = [b.ref_cnt for b in blocks]
    # ``_block_hash`` is the field behind the ``block_hash`` property; fall back if renamed.
    if blocks and hasattr(blocks[0], "_block_hash"):
        cached = [b._block_hash is not None for b in blocks]
    else:
        cached = [b.block_hash is not None for b in blocks]
    in_queue: list[bool] | None
    if blocks and hasattr(blocks[0], "prev_free_block"):
        in_queue = [b.prev_free_block is not None for b in blocks]
    else:
        in_queue = None
    null = getattr(block_pool, "null_block", None)
    nulls = frozenset({null.block_id}) if null is not None else frozenset()
    return PoolSnapshot(
        ref_counts=refs,
        cached=cached,
        num_free_reported=int(block_pool.get_num_free_blocks()),
        null_block_ids=nulls,
        in_free_queue=in_queue,
    )


def request_block_ids(kv_cache_manager: Any, request_id: str) -> list[int]:
    """The block ids in the engine's own block tables for one request (all KV groups).

    Uses ``req_to_blocks.get`` so that looking never creates an entry in vLLM's
    ``defaultdict``.
    """
    out: list[int] = []
    for mgr in _single_type_managers(kv_cache_manager):
        blocks = mgr.req_to_blocks.get(request_id)
        if blocks:
            out.extend(b.block_id for b in blocks if not getattr(b, "is_null", False))
    return out


def all_request_tables(kv_cache_manager: Any) -> dict[str, list[int]]:
    """Every request's block ids, from the engine's own tables (for claiming at audits)."""
    out: dict[str, list[int]] = {}
    for mgr in _single_type_managers(kv_cache_manager):
        for rid, blocks in mgr.req_to_blocks.items():
            if blocks:
                out.setdefault(rid, []).extend(
                    b.block_id for b in blocks if not getattr(b, "is_null", False)
                )
    return out


def _single_type_managers(kv_cache_manager: Any) -> list[Any]:
    coord = getattr(kv_cache_manager, "coordinator", None)
    return list(getattr(coord, "single_type_managers", ()) or ())
