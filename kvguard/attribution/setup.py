"""Build an engine's ``Attributor`` from kvguard settings and a vLLM scheduler.

Reads, with ``getattr`` (names drift between vLLM releases): the device
type (``vllm_config.device_config.device_type``), the world size (workers
in other processes are not measured from EngineCore) and the KV pool size
(``kv_cache_config``). Never raises: without what it needs it returns None
and the checkpoint reports carry no attribution.
"""

from __future__ import annotations

import logging
from typing import Any

from kvguard.attribution.attributor import AttributionSettings, Attributor
from kvguard.attribution.backends import MemoryHistoryBackend, TorchMemoryHistory
from kvguard.attribution.kv_pool import vllm_kv_pool_size
from kvguard.attribution.procedure import ProcedureSettings, open_probes
from kvguard.attribution.snapshot import Snapshotter
from kvguard.config import KvguardConfig
from kvguard.core.report import MemoryDomain

log = logging.getLogger("kvguard")

_DOMAINS = {"cuda": MemoryDomain.CUDA, "mps": MemoryDomain.MPS, "cpu": MemoryDomain.CPU}


def settings_from_config(config: KvguardConfig) -> AttributionSettings:
    return AttributionSettings(
        warmup_checkpoints=config.attribution_warmup_checkpoints,
        min_delta_bytes=config.attribution_min_bytes,
        procedure=ProcedureSettings(empty_cache=config.empty_cache_at_checkpoint,
                                    settle_seconds=config.settle_seconds))


def domain_of(device_type: object) -> MemoryDomain:
    """vLLM's device type (``cuda``, ``cpu``, ...) as a memory domain."""
    return _DOMAINS.get(str(device_type).lower(), MemoryDomain.OTHER)


def workers_in_process(executor_backend: object) -> bool | None:
    """vLLM's ``distributed_executor_backend``: ``uni`` runs the model in EngineCore itself.

    ``mp`` (vLLM's choice for CPU engines and TP > 1) and ``ray`` run it in worker
    processes; an unknown or custom backend gives None.
    """
    if executor_backend in ("uni", "external_launcher"):
        return True
    if executor_backend in ("mp", "ray"):
        return False
    return None


def attributor_for_vllm(scheduler: Any, config: KvguardConfig, *,
                        name: str) -> Attributor | None:
    """The attributor of one vLLM engine core, or None (attribution off or not buildable)."""
    if not config.attribution:
        return None
    try:
        vllm_config = getattr(scheduler, "vllm_config", None)
        device_type = getattr(getattr(vllm_config, "device_config", None), "device_type",
                              "cpu")
        parallel = getattr(vllm_config, "parallel_config", None)
        world = getattr(parallel, "world_size", None)
        domain = domain_of(device_type)
        probes = open_probes(domain, world_size=world if isinstance(world, int) else None,
                             workers_in_process=workers_in_process(
                                 getattr(parallel, "distributed_executor_backend", None)))
        kv = vllm_kv_pool_size(getattr(scheduler, "kv_cache_config", None))
        snapshots = None
        if config.snapshot_dir is not None:
            history: MemoryHistoryBackend | None = None
            why = f"memory history snapshots need CUDA; this engine runs on {domain.value}"
            if domain is MemoryDomain.CUDA:
                try:
                    history = TorchMemoryHistory()
                except Exception as exc:
                    why = f"torch.cuda.memory not usable: {exc}"
            snapshots = Snapshotter(config.snapshot_dir, history, name=name,
                                    why_unavailable=why)
        return Attributor(settings_from_config(config), probes, kv=kv, snapshots=snapshots)
    except Exception as exc:
        log.error("kvguard memory attribution is off for engine %s: %s", name, exc,
                  exc_info=exc)
        return None
