"""Read a vLLM ``BlockPool`` into an engine-agnostic ``PoolSnapshot``.

Reads ``KVCacheBlock.ref_cnt``, the prefix-cache hash and free-queue
membership of every block (a block is in vLLM's doubly linked free queue iff
its ``prev_free_block`` is set: the queue has sentinel head and tail blocks).
Must run on the engine's scheduler thread, between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

from kvguard.core.snapshot import PoolSlice, PoolSnapshot
from kvguard.vllm_plugin.versions import (
    BLOCK_HASH_FIELD,
    BLOCK_HASH_SLOT,
    BLOCK_IS_NULL,
    BLOCK_OWNER_POOL,
    BLOCK_POOL_NULL_BLOCK,
    BLOCK_PREV_FREE,
    COORDINATOR_SINGLE_TYPE_MANAGERS,
    KVM_COORDINATOR,
    block_hash_attr,
    pool_tag,
    read,
)


def read_pool(block_pool: Any, *, walk_free_queue: bool = False) -> PoolSnapshot:
    """Snapshot the pool. Reads every ``ref_cnt`` once; the rest is read only if needed.

    Two passes over the blocks: every ``ref_cnt``, then the ref counts of the cached
    blocks (those with a prefix hash), which count the evictable ones. No list of hashes
    is built: :class:`BlockHashes` reads a block's hash when the reconciler asks, for
    the few blocks it judges one by one. Measured on 100,000 blocks against the bare
    ``ref_cnt`` loop: the second pass costs 1.1-1.3x, the list of hashes with its counts
    1.8x (drained) to 2.5x (busy). The free queue is walked (one more per-block read,
    and then the hashes are read into a list, since every block is judged) only when
    ``walk_free_queue`` is set or when the pool's free count disagrees with the number of
    blocks whose ref count is 0 - the only case where membership matters.

    The snapshot's ``cached`` reads the live blocks: reconcile it in the same pause
    between steps (as every caller does).
    """
    blocks = block_pool.blocks
    refs = [b.ref_cnt for b in blocks]
    n = len(blocks)
    null = read(block_pool, BLOCK_POOL_NULL_BLOCK)
    nulls = frozenset({null.block_id}) if null is not None else frozenset()
    num_free = int(block_pool.get_num_free_blocks())
    zero_refs = refs.count(0)
    n_zero = zero_refs - sum(1 for b in nulls if b < n and refs[b] == 0)
    if (walk_free_queue or n_zero != num_free) and blocks \
            and hasattr(blocks[0], BLOCK_PREV_FREE.name):
        in_queue = bytearray([b.prev_free_block is not None for b in blocks])
        return PoolSnapshot(ref_counts=refs, cached=_read_hashes(blocks),
                            num_free_reported=num_free, null_block_ids=nulls,
                            in_free_queue=in_queue, zero_refs=zero_refs)
    hashes = BlockHashes(blocks)
    return PoolSnapshot(ref_counts=refs, cached=hashes, num_free_reported=num_free,
                        null_block_ids=nulls, zero_refs=zero_refs,
                        cached_unreferenced=hashes.ref_counts_of_cached().count(0))


def _hash_attr(blocks: Sequence[Any]) -> str:
    """Where this vLLM's blocks keep their prefix hash (the version layer's
    :func:`~kvguard.vllm_plugin.versions.block_hash_attr`: ``_block_hash`` in 0.32 and
    0.33, ``block_hash`` in 0.34)."""
    return block_hash_attr(blocks[0]) if blocks else BLOCK_HASH_FIELD.name


def _read_hashes(blocks: list[Any]) -> list[Any]:
    """Every block's prefix hash (``None``: not cached), in one pass.

    A list comprehension, not ``map(attrgetter(...))``: ``KVCacheBlock`` has ``__slots__``,
    and CPython 3.11+ specialises a comprehension's attribute load for slots, which makes
    it 2.5x faster than ``attrgetter``'s generic lookup (2.1 vs 5.3 ms per 100,000
    blocks measured, both fields). The hash is truthy exactly when the block is cached.
    """
    if _hash_attr(blocks) == BLOCK_HASH_SLOT.name:
        return [b._block_hash for b in blocks]
    return [b.block_hash for b in blocks]


class BlockHashes(Sequence[object]):
    """The prefix hash of each block of a pool, read from the block when indexed.

    What :func:`read_pool` gives as :attr:`PoolSnapshot.cached`: the reconciler reads it
    for the few blocks it judges one by one and counts the rest through
    :attr:`PoolSnapshot.cached_unreferenced`. A read is the block's hash *now*: use it
    on the scheduler thread, between steps, in the same pause as the ``ref_cnt`` pass it
    goes with (as every caller of :func:`read_pool` does).
    """

    __slots__ = ("_attr", "_blocks")

    def __init__(self, blocks: list[Any]) -> None:
        self._blocks = blocks
        self._attr = _hash_attr(blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    @overload
    def __getitem__(self, index: int) -> object: ...
    @overload
    def __getitem__(self, index: slice) -> list[object]: ...
    def __getitem__(self, index: int | slice) -> object:
        if isinstance(index, slice):
            return [getattr(b, self._attr) for b in self._blocks[index]]
        return getattr(self._blocks[index], self._attr)

    def ref_counts_of_cached(self) -> list[int]:
        """The ``ref_cnt`` of every block that carries a hash, in block order: one pass,
        with no list of hashes built (``.count(0)``: the evictable ones)."""
        if self._attr == BLOCK_HASH_SLOT.name:
            return [b.ref_cnt for b in self._blocks if b._block_hash is not None]
        return [b.ref_cnt for b in self._blocks if b.block_hash is not None]


def request_block_ids(kv_cache_manager: Any, request_id: str) -> list[int]:
    """The block ids in the engine's own block tables for one request (all KV groups).

    Uses ``req_to_blocks.get`` so that looking never creates an entry in vLLM's
    ``defaultdict``.
    """
    out: list[int] = []
    tag = pool_tag(kv_cache_manager.block_pool)
    for mgr in _single_type_managers(kv_cache_manager):
        blocks = mgr.req_to_blocks.get(request_id)
        if blocks:
            out.extend(block_ids_in(blocks, tag))
    return out


def counts_in(block: Any, pool: Any) -> bool:
    """Whether a block table entry is one of ``pool``'s blocks: not the null block, and not
    a block of another pool (a KV group bound to a private pool, e.g. a host pool, draws
    its ids from that pool; the same id there is a different block). ``block.pool`` unset
    (older vLLM) means the engine's one pool. ``pool``: the pool, or its
    :func:`~kvguard.vllm_plugin.versions.pool_tag` (what its blocks hold: the pool itself
    before vLLM 0.34, a weak reference to it from 0.34)."""
    if read(block, BLOCK_IS_NULL, False):
        return False
    owner = read(block, BLOCK_OWNER_POOL)
    return owner is None or owner is pool_tag(pool)


def block_ids_in(blocks: Sequence[Any], pool: Any) -> list[int]:
    """The ids of the ``blocks`` that :func:`counts_in` ``pool`` (the pool, or its
    :func:`~kvguard.vllm_plugin.versions.pool_tag`: the hooks pass the tag, read once), in
    order.

    One comprehension reading the slots directly (no call per block): every hook that
    sees blocks move calls this, so it is on the engine's hot path. Blocks without a
    ``pool`` slot (older vLLM) take the per-block :func:`counts_in`.
    """
    tag = pool_tag(pool)
    try:
        return [b.block_id for b in blocks
                if (b.pool is tag or b.pool is None) and not b.is_null]
    except AttributeError:
        return [b.block_id for b in blocks if counts_in(b, tag)]


def all_request_tables(kv_cache_manager: Any) -> dict[str, list[int]]:
    """Every request's block ids, from the engine's own tables (for claiming at audits)."""
    out: dict[str, list[int]] = {}
    tag = pool_tag(kv_cache_manager.block_pool)
    for mgr in _single_type_managers(kv_cache_manager):
        for rid, blocks in mgr.req_to_blocks.items():
            if blocks:
                out.setdefault(rid, []).extend(block_ids_in(blocks, tag))
    return out


def _single_type_managers(kv_cache_manager: Any) -> list[Any]:
    coord = read(kv_cache_manager, KVM_COORDINATOR)
    return list(read(coord, COORDINATOR_SINGLE_TYPE_MANAGERS, ()) or ())


class VllmPoolAccess:
    """The online audit's view of one vLLM ``BlockPool`` and its block tables.

    Every read is one pass over a slice of ``block_pool.blocks``; call it on
    the scheduler thread between steps (``update_from_output`` has returned).
    """

    def __init__(self, kv_cache_manager: Any) -> None:
        self._kvm = kv_cache_manager
        self._pool = kv_cache_manager.block_pool
        self._tag = pool_tag(self._pool)
        self._blocks: list[Any] = self._pool.blocks
        null = read(self._pool, BLOCK_POOL_NULL_BLOCK)
        self._nulls = frozenset({null.block_id}) if null is not None else frozenset()
        self._has_queue = bool(self._blocks) and hasattr(self._blocks[0], BLOCK_PREV_FREE.name)
        self._tables: list[Any] = [m.req_to_blocks for m in
                                   _single_type_managers(kv_cache_manager)]
        """Each KV group's ``req_to_blocks`` (vLLM builds them once, with the coordinator):
        read per lifecycle event, so looked up once here."""

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def null_block_ids(self) -> frozenset[int]:
        return self._nulls

    def read(self, lo: int, hi: int) -> PoolSlice:
        sl = self._blocks[lo:hi]
        refs = [b.ref_cnt for b in sl]
        cached = _read_hashes(sl)
        # Tested by identity: comparing blocks to None would run their Python __eq__.
        out_of_queue = [b.prev_free_block is None for b in sl].count(True) \
            if self._has_queue else None
        return PoolSlice(refs, cached, out_of_queue)

    def in_free_queue(self, lo: int, hi: int) -> list[bool]:
        return [b.prev_free_block is not None for b in self._blocks[lo:hi]]

    def request_ids(self) -> list[str]:
        seen: dict[str, None] = {}
        for mgr in _single_type_managers(self._kvm):
            for rid, blocks in mgr.req_to_blocks.items():
                if blocks:
                    seen[rid] = None
        return list(seen)

    def request_blocks(self, request_id: str) -> list[int]:
        """The request's block ids in the engine's tables (as :func:`request_block_ids`),
        on the hooks' hot path: one ``get`` per KV group."""
        if len(self._tables) == 1:
            blocks = self._tables[0].get(request_id)
            return block_ids_in(blocks, self._tag) if blocks else []
        out: list[int] = []
        for table in self._tables:
            blocks = table.get(request_id)
            if blocks:
                out.extend(block_ids_in(blocks, self._tag))
        return out

    def num_free(self) -> int:
        return int(self._pool.get_num_free_blocks())
