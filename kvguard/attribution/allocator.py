"""Allocator probes: PyTorch's CUDA caching allocator and MPS (bytes).

CUDA: ``memory_allocated`` (live tensors), ``memory_reserved`` (what the
caching allocator holds; allocated sits inside it), and from
``memory_stats``: ``active_bytes.all.current``,
``inactive_split_bytes.all.current`` (cache stuck in split segments:
fragmentation evidence), ``allocated_bytes.all.peak``, ``num_alloc_retries``
(the allocator had to free cache and retry a failed ``cudaMalloc``),
``num_ooms``; and the allocator backend (``native``, ``cudaMallocAsync``:
the async backend reports fewer statistics, which are then listed as
unavailable).

MPS: ``current_allocated_memory`` (tensors) as allocated and
``driver_allocated_memory`` (what the Metal driver holds for this process,
cache included) as reserved.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvguard.attribution.backends import CudaBackend, MpsBackend
from kvguard.attribution.reading import guarded
from kvguard.core.report import AllocatorReport, MemoryDomain

STAT_ACTIVE = "active_bytes.all.current"
STAT_INACTIVE_SPLIT = "inactive_split_bytes.all.current"
STAT_PEAK = "allocated_bytes.all.peak"
STAT_RETRIES = "num_alloc_retries"
STAT_OOMS = "num_ooms"


def read_cuda_allocator(cuda: CudaBackend) -> AllocatorReport:
    """The CUDA allocator section now (the caller synchronized first). Never raises."""
    unavailable: list[str] = []
    allocated = guarded("allocated", cuda.memory_allocated, unavailable)
    reserved = guarded("reserved", cuda.memory_reserved, unavailable)
    stats: Mapping[str, int] = guarded("memory_stats", cuda.memory_stats, unavailable) or {}
    backend = guarded("allocator_backend", cuda.allocator_backend, unavailable)

    def stat(key: str) -> int | None:
        if key not in stats:
            if stats:
                unavailable.append(f"{key}: not in memory_stats (backend {backend})")
            return None
        return int(stats[key])

    return AllocatorReport(
        domain=MemoryDomain.CUDA, backend=backend, allocated_bytes=allocated,
        reserved_bytes=reserved, active_bytes=stat(STAT_ACTIVE),
        inactive_split_bytes=stat(STAT_INACTIVE_SPLIT), peak_allocated_bytes=stat(STAT_PEAK),
        num_alloc_retries=stat(STAT_RETRIES), num_ooms=stat(STAT_OOMS),
        unavailable=unavailable)


def read_mps_allocator(mps: MpsBackend) -> AllocatorReport:
    """The MPS allocator section now. Never raises."""
    unavailable: list[str] = []
    allocated = guarded("current_allocated_memory", mps.current_allocated_memory, unavailable)
    driver = guarded("driver_allocated_memory", mps.driver_allocated_memory, unavailable)
    unavailable.append("inactive_split, num_alloc_retries, num_ooms: MPS reports no such "
                       "statistics")
    return AllocatorReport(domain=MemoryDomain.MPS, backend="mps", allocated_bytes=allocated,
                           reserved_bytes=driver, unavailable=unavailable)
