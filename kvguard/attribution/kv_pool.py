"""Bytes of an engine's KV pool: ``num_blocks x bytes_per_block``.

The pool is one (or a few) tensors allocated once at engine start; its size
does not change while the engine runs, which is why a KV block leak moves no
tensor counter. The vLLM reader is ``getattr``-guarded: names drift between
releases, and an unknown layout gives None rather than a wrong number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KvPoolSize:
    """Invariant: ``num_blocks >= 1`` and ``bytes_per_block >= 0``."""

    num_blocks: int
    bytes_per_block: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def vllm_kv_pool_size(kv_cache_config: Any) -> KvPoolSize | None:
    """From vLLM's ``KVCacheConfig`` (``scheduler.kv_cache_config``), or None.

    vLLM 0.32 places every ``KVCacheTensor`` in one backing allocation of
    ``size`` bytes (they carry ``layer_stride``; groups may alias the same
    bytes), so the pool is that one size. Older layouts had one allocation
    per ``KVCacheTensor``: their sizes add up.
    """
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
    if not isinstance(num_blocks, int) or num_blocks < 1 or not tensors:
        return None
    sizes = [s for s in (getattr(t, "size", None) for t in tensors)
             if isinstance(s, int) and s >= 0]
    if len(sizes) != len(tensors):
        return None
    shared_backing = all(hasattr(t, "layer_stride") for t in tensors)
    total = max(sizes) if shared_backing else sum(sizes)
    return KvPoolSize(num_blocks=num_blocks, bytes_per_block=total // num_blocks)
