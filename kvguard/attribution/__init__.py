"""Memory attribution at drained checkpoints: which boundary moved, and what to do.

Beside the pool verdict, each drained checkpoint reads the framework
allocator (PyTorch CUDA or MPS), the device (NVML or ``mem_get_info``) and
the host (RSS, swap, available memory), compares them with a baseline taken
after warm-up, and names the boundary that moved: live tensors, allocator
cache, fragmentation, memory outside the framework, the KV pool, process
memory, host swap or a transient peak (design.md sections 2 and 3).

Modules, one job each: ``backends`` (protocols and real adapters),
``allocator``/``device``/``host`` (probes), ``procedure`` (synchronize,
return cache, settle, read once), ``attribute`` (the comparison),
``wording`` (what people read), ``snapshot`` (memory history files),
``kv_pool`` (pool bytes), ``attributor`` (warm-up, baseline, per-engine
state), ``setup`` (from kvguard settings and a vLLM scheduler).
"""

from kvguard.attribution.attribute import Context, attribute, kv_pool_finding
from kvguard.attribution.attributor import AttributionResult, AttributionSettings, Attributor
from kvguard.attribution.kv_pool import KvPoolSize, vllm_kv_pool_size
from kvguard.attribution.procedure import (
    MemorySample,
    ProbeSet,
    ProcedureSettings,
    open_probes,
    take_sample,
)

__all__ = [
    "AttributionResult",
    "AttributionSettings",
    "Attributor",
    "Context",
    "KvPoolSize",
    "MemorySample",
    "ProbeSet",
    "ProcedureSettings",
    "attribute",
    "kv_pool_finding",
    "open_probes",
    "take_sample",
    "vllm_kv_pool_size",
]
