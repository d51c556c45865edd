"""Copy arithmetic of vLLM's CPU offload tier, as plain torch-CPU copies.

This mirrors ``SingleDirectionOffloadingHandler._fill_direct_ops`` of vLLM 0.32
(``vllm/v1/kv_offload/cpu/gpu_worker.py``, the direct, worker-private layout)
without its CUDA descriptors, so that :mod:`kvguard.testing.offload_worker` moves
exactly the bytes vLLM's GPU worker would move.

Units and invariants:

* A *device page* is one KV block of one canonical tensor: ``page_bytes`` bytes
  (the tensor's padded page size). An offload *chunk* holds ``blocks_per_chunk``
  device pages back to back: the offload tensor of canonical tensor ``t`` has
  shape ``(num_chunks, page_bytes[t] * blocks_per_chunk)``, dtype int8.
* The device side of a transfer (:class:`~vllm.v1.kv_offload.base.GPULoadStoreSpec`)
  lists device blocks group by group (``group_sizes``); ``block_indices[g]`` is the
  request-logical index of group ``g``'s first block. Its first block sits at
  sub-page ``block_indices[g] % blocks_per_chunk`` of the group's first chunk
  (vLLM's ``skip_count``); the chunk side lists
  ``ceil((group_size + skip) / blocks_per_chunk)`` chunks for the group.
* Each (block, layer reference) pair copies ``ref.page_size_bytes`` bytes (the
  *unpadded* page) from the start of the page; layers that alias one tensor each
  copy (and count) their bytes, as vLLM does. :attr:`CopyOp.nbytes` summed is the
  ``transfer_size`` vLLM reports in ``vllm:kv_offload_{store,load}_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CopyOp", "RefShape", "apply_copies", "plan_copies"]


@dataclass(frozen=True, slots=True)
class RefShape:
    """One layer reference of one KV cache group: which tensor, how many bytes per block."""

    tensor_idx: int
    page_size_bytes: int
    """Unpadded page bytes copied per block (<= the tensor's padded page)."""


@dataclass(frozen=True, slots=True)
class CopyOp:
    """One contiguous byte copy between a device page and a slot of a chunk."""

    tensor_idx: int
    device_block: int
    chunk: int
    chunk_offset: int
    """Byte offset of the slot inside the chunk row: ``sub_page * page_bytes[tensor]``."""
    nbytes: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_copies(
    device_blocks: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    chunk_ids: Sequence[int],
    refs_per_group: Sequence[Sequence[RefShape]],
    page_bytes: Sequence[int],
    blocks_per_chunk: int,
) -> list[CopyOp]:
    """Every byte copy of one transfer, in vLLM's order (group, layer, block).

    Raises:
        ValueError: the specs disagree (block or chunk counts, group counts); vLLM
            asserts the same things in its GPU worker.
    """
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    if len(group_sizes) != len(refs_per_group) or len(block_indices) != len(group_sizes):
        raise ValueError(f"{len(group_sizes)} group sizes, {len(block_indices)} block "
                         f"indices and {len(refs_per_group)} groups of layers must agree")
    if sum(group_sizes) != len(device_blocks):
        raise ValueError(f"group sizes sum to {sum(group_sizes)}, "
                         f"but {len(device_blocks)} device blocks were given")
    ops: list[CopyOp] = []
    dev_off = 0
    chunk_off = 0
    for size, first_idx, refs in zip(group_sizes, block_indices, refs_per_group, strict=True):
        if size == 0:
            continue
        skip = first_idx % blocks_per_chunk
        n_chunks = _cdiv(size + skip, blocks_per_chunk)
        if chunk_off + n_chunks > len(chunk_ids):
            raise ValueError(f"the chunk side lists {len(chunk_ids)} chunks; "
                             f"at least {chunk_off + n_chunks} are needed")
        for ref in refs:
            page = page_bytes[ref.tensor_idx]
            if ref.page_size_bytes > page:
                raise ValueError(f"a layer copies {ref.page_size_bytes} bytes per block "
                                 f"from pages of {page} bytes")
            for i in range(size):
                flat = skip + i
                ops.append(CopyOp(
                    tensor_idx=ref.tensor_idx,
                    device_block=int(device_blocks[dev_off + i]),
                    chunk=int(chunk_ids[chunk_off + flat // blocks_per_chunk]),
                    chunk_offset=(flat % blocks_per_chunk) * page,
                    nbytes=ref.page_size_bytes,
                ))
        dev_off += size
        chunk_off += n_chunks
    if chunk_off != len(chunk_ids):
        raise ValueError(f"the chunk side lists {len(chunk_ids)} chunks, "
                         f"the device side covers {chunk_off}")
    return ops


def apply_copies(
    ops: Sequence[CopyOp],
    device: Sequence[torch.Tensor],
    offload: Sequence[torch.Tensor],
    to_offload: bool,
) -> int:
    """Run ``ops``: device -> offload tier (a store) or back (a load). Returns bytes copied.

    ``device[t]`` is ``(num_blocks, page_bytes[t])`` int8, ``offload[t]`` is
    ``(num_chunks, page_bytes[t] * blocks_per_chunk)`` int8 (views of the real
    KV cache and of the tier's own tensors).
    """
    total = 0
    for op in ops:
        dev = device[op.tensor_idx][op.device_block, : op.nbytes]
        off = offload[op.tensor_idx][op.chunk, op.chunk_offset : op.chunk_offset + op.nbytes]
        if to_offload:
            off.copy_(dev)
        else:
            dev.copy_(off)
        total += op.nbytes
    return total
