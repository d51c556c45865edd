"""KV pool bytes from vLLM's KVCacheConfig (shapes of 0.32 and of older layouts), and wording."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from kvguard.attribution.kv_pool import KvPoolSize, vllm_kv_pool_size
from kvguard.attribution.wording import fmt_bytes, fmt_delta


def test_vllm_032_one_backing_allocation_shared_by_every_kv_cache_tensor() -> None:
    # the tiny test model: 64 blocks, 2 layers x 8 KiB pages in one 1 MiB allocation
    cfg = NS(num_blocks=64, kv_cache_tensors=[
        NS(size=1 << 20, layers=["l0", "l1"], layer_stride=512 << 10, block_stride=8 << 10)])
    assert vllm_kv_pool_size(cfg) == KvPoolSize(num_blocks=64, bytes_per_block=16 << 10)
    # cache groups overlaying the same backing bytes are not counted twice
    cfg.kv_cache_tensors.append(NS(size=1 << 20, layers=["l2"], layer_stride=0,
                                   block_stride=16 << 10))
    assert vllm_kv_pool_size(cfg) == KvPoolSize(64, 16 << 10)


def test_older_layout_one_allocation_per_kv_cache_tensor() -> None:
    cfg = NS(num_blocks=100, kv_cache_tensors=[NS(size=400_000, shared_by=["a"]),
                                               NS(size=400_000, shared_by=["b"])])
    assert vllm_kv_pool_size(cfg) == KvPoolSize(100, 8000)
    assert KvPoolSize(100, 8000).total_bytes == 800_000


@pytest.mark.parametrize("cfg", [
    None, NS(), NS(num_blocks=0, kv_cache_tensors=[NS(size=1)]),
    NS(num_blocks=4, kv_cache_tensors=[]), NS(num_blocks=4, kv_cache_tensors=[NS(size="x")]),
])
def test_unknown_shapes_give_none_not_a_wrong_number(cfg: object) -> None:
    assert vllm_kv_pool_size(cfg) is None


def test_byte_wording() -> None:
    assert fmt_bytes(None) == "?" and fmt_bytes(512) == "512 B" and fmt_bytes(16384) == "16 KiB"
    assert fmt_bytes(412 << 20) == "412.0 MiB" and fmt_bytes(3 << 29) == "1.50 GiB"
    assert fmt_delta(-(3 << 20)) == "-3.0 MiB" and fmt_delta(0) == "+0 B"
