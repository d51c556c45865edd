"""The torch-CPU offloading worker's copy arithmetic and timing, against vLLM's own specs.

No engine: vLLM's ``GPULoadStoreSpec``/``CPULoadStoreSpec`` and ``CanonicalKVCaches``
built by hand, on tensors whose every page has distinct bytes, so a wrong offset shows.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvguard.errors import ConfigError
from kvguard.testing.offload_copy import CopyOp, RefShape, plan_copies
from kvguard.testing.offload_worker import OffloadFaults, TorchCpuOffloadingWorker

PAGE = 64
UNPADDED = 48  # a padded page: only the first 48 bytes of each page are KV
NUM_BLOCKS = 10


def _caches() -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """Two canonical tensors; group 0 uses both, with distinct bytes in every page."""
    tensors = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8,
                             generator=torch.Generator().manual_seed(t)) for t in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, UNPADDED), CanonicalKVCacheRef(1, UNPADDED)]])
    return caches, tensors


@pytest.mark.parametrize("bpc", [1, 2])
def test_store_then_load_round_trips_the_unpadded_bytes(bpc: int) -> None:
    caches, device = _caches()
    w = TorchCpuOffloadingWorker(caches, bpc, num_chunks=8,
                                 faults=OffloadFaults(complete_after_steps=2))
    blocks = [3, 7, 5, 1]  # logical blocks 1..4 of a request: starts mid-chunk when bpc 2
    chunks = [4, 2, 6] if bpc == 2 else [4, 2, 6, 0]
    original = [t.clone() for t in device]
    assert w.submit_store(0, GPULoadStoreSpec(blocks, [4], [1]), CPULoadStoreSpec(chunks))
    assert w.get_finished() == []  # in flight for 2 steps: nothing copied yet
    assert all(int(t.abs().sum()) == 0 for t in w.offload)
    (res,) = w.get_finished()
    assert (res.job_id, res.success) == (0, True)
    assert res.transfer_size == 4 * 2 * UNPADDED  # blocks x layer refs x unpadded page
    skip = 1 % bpc
    for t in range(2):
        for i, b in enumerate(blocks):
            flat = skip + i
            row, sub = chunks[flat // bpc], flat % bpc
            got = w.offload[t][row, sub * PAGE: sub * PAGE + UNPADDED]
            assert torch.equal(got, original[t][b, :UNPADDED]), (t, i)
    # Wipe the device blocks, load them back into other blocks.
    targets = [0, 2, 4, 6]
    for t in device:
        t[targets] = 0
    assert w.submit_load(1, CPULoadStoreSpec(chunks), GPULoadStoreSpec(targets, [4], [1]))
    w.get_finished()
    (res,) = w.get_finished()
    assert res.job_id == 1 and res.transfer_size == 4 * 2 * UNPADDED
    for t in range(2):
        for src, dst in zip(blocks, targets, strict=True):
            assert torch.equal(device[t][dst, :UNPADDED], original[t][src, :UNPADDED])
            assert int(device[t][dst, UNPADDED:].abs().sum()) == 0  # padding not copied


def test_plan_matches_vllm_skip_and_chunk_counts() -> None:
    refs = [[RefShape(0, 16)]]
    ops = plan_copies([9, 8, 7], [3], [3], [5, 6], refs, [16], blocks_per_chunk=2)
    assert ops == [CopyOp(0, 9, 5, 16, 16), CopyOp(0, 8, 6, 0, 16), CopyOp(0, 7, 6, 16, 16)]
    with pytest.raises(ValueError, match="chunk side lists 1"):
        plan_copies([9, 8, 7], [3], [3], [5], refs, [16], blocks_per_chunk=2)
    with pytest.raises(ValueError, match="device side covers 2"):
        plan_copies([9, 8, 7], [3], [3], [5, 6, 7], refs, [16], blocks_per_chunk=2)


def test_completions_in_order_and_a_fence_copies_at_once() -> None:
    caches, device = _caches()
    w = TorchCpuOffloadingWorker(caches, 1, num_chunks=8,
                                 faults=OffloadFaults(complete_after_steps=5))
    for job in range(3):
        w.submit_store(job, GPULoadStoreSpec([job], [1], [0]), CPULoadStoreSpec([job]))
    before = device[0][1, :UNPADDED].clone()
    w.wait({1})  # vLLM's fence before block 1 is re-allocated: bytes move now
    device[0][1] = 0  # the new owner overwrites the block
    assert torch.equal(w.offload[0][1, :UNPADDED], before)
    # Job 1 is done but job 0 is not: reports keep submission order.
    assert w.get_finished() == []
    w.wait({0})
    assert [r.job_id for r in w.get_finished()] == [0, 1]
    assert [r.job_id for r in w.get_finished() + w.get_finished() + w.get_finished()] == [2]


def test_lost_completions_stay_lost_until_released_and_do_not_block_later_jobs() -> None:
    caches, _ = _caches()
    w = TorchCpuOffloadingWorker(caches, 1, num_chunks=8,
                                 faults=OffloadFaults(lose_store_every=2))
    for job in range(4):
        w.submit_store(job, GPULoadStoreSpec([job], [1], [0]), CPULoadStoreSpec([job]))
    assert [r.job_id for r in w.get_finished()] == [0, 2]
    assert w.lost_job_ids == {1, 3}
    assert w.bytes_copied[0] == 4 * 2 * UNPADDED  # the bytes moved; only the report is lost
    w.wait({1})  # a fence on a lost job copies (again: no-op) and still reports nothing
    assert w.get_finished() == []
    w.arm_loss(loads=1)
    w.submit_load(9, CPULoadStoreSpec([0]), GPULoadStoreSpec([9], [1], [0]))
    assert w.get_finished() == [] and w.lost_job_ids == {1, 3, 9}
    assert w.release_lost() == [1, 3, 9]
    assert sorted(r.job_id for r in w.get_finished()) == [1, 3, 9]
    assert w.jobs_in_flight == 0 and w.get_finished() == []


def test_fault_keys_are_checked() -> None:
    assert OffloadFaults.from_extra_config({"cpu_bytes_to_use": 1}) == OffloadFaults()
    with pytest.raises(ConfigError, match="kvguard_lose_every"):
        OffloadFaults.from_extra_config({"kvguard_lose_every": 1})
    with pytest.raises(ConfigError, match="kvguard_complete_after_steps"):
        OffloadFaults.from_extra_config({"kvguard_complete_after_steps": 0})
