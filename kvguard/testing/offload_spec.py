"""``TorchCpuOffloadingSpec``: vLLM's ``CPUOffloadingSpec`` with a torch-CPU worker.

Selected through the OffloadingConnector's ``kv_connector_extra_config``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
         "spec_name": "TorchCpuOffloadingSpec",
         "spec_module_path": "kvguard.testing.offload_spec",
         "cpu_bytes_to_use": 8388608,             # vLLM's own keys, unchanged
         "kvguard_complete_after_steps": 2,       # faults: kvguard.testing.offload_worker
         "kvguard_lose_store_every": 0,
         "kvguard_lose_load_every": 0}}

Everything but the worker is vLLM's: the scheduler side, ``CPUOffloadingManager``
(chunk accounting, LRU eviction), the metrics. Only :meth:`get_worker` is overridden,
because vLLM's refuses a CPU-only platform. **Test/chaos tooling**: on a GPU use vLLM's
own ``CPUOffloadingSpec``; see :mod:`kvguard.testing.offload_worker`.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvguard.testing.offload_worker import OffloadFaults, TorchCpuOffloadingWorker

__all__ = ["SPEC_MODULE_PATH", "SPEC_NAME", "TorchCpuOffloadingSpec", "offload_transfer_config"]

SPEC_NAME = "TorchCpuOffloadingSpec"
SPEC_MODULE_PATH = "kvguard.testing.offload_spec"


class TorchCpuOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec whose worker copies with torch on CPU."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # Parsed here, on both sides, so that a bad key fails engine start-up (scheduler
        # side, EngineCore) with kvguard's message, not later in a worker.
        self.faults = OffloadFaults.from_extra_config(dict(self.extra_config))
        self._torch_worker: TorchCpuOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The torch-CPU worker (one per spec, as vLLM's ``get_worker`` keeps one)."""
        if self._torch_worker is None:
            self._torch_worker = TorchCpuOffloadingWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks, self.faults)
        return self._torch_worker


def offload_transfer_config(cpu_bytes_to_use: int = 8 << 20,
                            **extra: object) -> dict[str, object]:
    """A ``kv_transfer_config`` dict running vLLM's OffloadingConnector with this spec.

    ``extra`` adds ``kv_connector_extra_config`` keys (vLLM's, e.g. ``block_size``, or
    the ``kvguard_*`` fault keys)."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE_PATH,
                "cpu_bytes_to_use": cpu_bytes_to_use, **extra}}
