"""The checkpoint procedure: synchronize, (optionally) return cache, settle, read once.

Order, at a drained checkpoint only (never on every step):

1. **synchronize** the device (``torch.cuda.synchronize`` / ``torch.mps.synchronize``)
   so that no kernel or pending free is in flight;
2. **return allocator cache**, only when asked (``KVGUARD_EMPTY_CACHE_AT_CHECKPOINT``):
   ``gc.collect()`` then ``empty_cache()``. It frees no storage that is still
   referenced, and the next steps pay to get the pages back, which is why it
   is off by default and never done per step;
3. **settle**: after a cache return, wait ``settle_seconds`` before reading
   process-level numbers; the release reaches the driver and the process
   footprint only hundreds of milliseconds later (measured: about 500 ms).
   Without a cache return nothing is being released, so there is no wait
   and a default checkpoint never blocks the engine thread;
4. **read** allocator, device and host counters back to back, in one window
   whose length is recorded, with versions, allocator backend and process
   scope beside them.

A CUDA probe never creates a CUDA context: in a process where CUDA is not
initialized (e.g. an EngineCore whose workers are other processes) it says
so instead of reading.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.attribution.allocator import read_cuda_allocator, read_mps_allocator
from kvguard.attribution.backends import (
    CudaBackend,
    HostBackend,
    MpsBackend,
    NvmlBackend,
    SystemHost,
    TorchCuda,
    TorchMps,
)
from kvguard.attribution.device import open_nvml, read_device
from kvguard.attribution.host import read_host
from kvguard.attribution.reading import guarded
from kvguard.core.report import (
    AllocatorReport,
    DeviceReport,
    HostReport,
    MemoryDomain,
    ProbeScope,
)

DEFAULT_SETTLE_SECONDS = 0.5
"""Seconds between a cache return and the process-level reads (see step 3)."""


@dataclass(frozen=True, slots=True)
class ProcedureSettings:
    empty_cache: bool = False
    """Return allocator cache at each drained checkpoint (``KVGUARD_EMPTY_CACHE_AT_CHECKPOINT``)."""
    settle_seconds: float = DEFAULT_SETTLE_SECONDS
    """Wait after a cache return, seconds >= 0 (``KVGUARD_SETTLE_SECONDS``)."""


@dataclass(slots=True)
class ProbeSet:
    """The backends of one engine process. NVML is opened at first use, once."""

    domain: MemoryDomain
    host: HostBackend
    cuda: CudaBackend | None = None
    mps: MpsBackend | None = None
    world_size: int | None = None
    workers_in_process: bool | None = None
    """False: the model runs in worker processes (their RSS is read as child processes)."""
    nvml_opener: Callable[[CudaBackend | None], tuple[NvmlBackend | None, str | None]] = \
        open_nvml
    _nvml: tuple[NvmlBackend | None, str | None] | None = field(default=None, repr=False)

    def nvml(self) -> tuple[NvmlBackend | None, str | None]:
        if self._nvml is None:
            self._nvml = self.nvml_opener(self.cuda)
        return self._nvml


def open_probes(domain: MemoryDomain, *, world_size: int | None = None,
                workers_in_process: bool | None = None) -> ProbeSet:
    """The real backends for an engine whose tensors live in ``domain``. Never raises."""
    cuda: CudaBackend | None = None
    mps: MpsBackend | None = None
    try:
        if domain is MemoryDomain.CUDA:
            cuda = TorchCuda()
        elif domain is MemoryDomain.MPS:
            mps = TorchMps()
    except Exception:  # torch not importable: the sample says the allocator is unavailable
        pass
    return ProbeSet(domain=domain, host=SystemHost(), cuda=cuda, mps=mps, world_size=world_size,
                    workers_in_process=workers_in_process)


@dataclass(frozen=True, slots=True)
class MemorySample:
    """Every counter of one checkpoint, read in one window."""

    allocator: AllocatorReport
    device: DeviceReport | None
    host: HostReport
    scope: ProbeScope


def take_sample(probes: ProbeSet, settings: ProcedureSettings, *,
                sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.perf_counter) -> MemorySample:
    """Run steps 1-4 and return the sample. Never raises for a probe failure."""
    notes: list[str] = []
    cuda = probes.cuda
    cuda_live = bool(cuda is not None and guarded("cuda", cuda.is_initialized, notes))
    device_api: CudaBackend | MpsBackend | None = (
        cuda if cuda_live else probes.mps if probes.domain is MemoryDomain.MPS else None)
    synchronized = cache_returned = False
    if device_api is not None:
        synchronized = _call("synchronize", device_api.synchronize, notes)
    if settings.empty_cache:
        gc.collect()
        if device_api is not None:
            cache_returned = _call("empty_cache", device_api.empty_cache, notes)
    settled = settings.settle_seconds if cache_returned else 0.0
    if settled > 0:
        sleep(settled)

    pid = os.getpid()
    t0 = clock()
    allocator, device, driver, sees = _read_device_side(probes, cuda_live, pid, notes)
    host = read_host(probes.host, include_children=probes.workers_in_process is False)
    window = max(0.0, clock() - t0)

    torch_version, cuda_version = _versions(probes, cuda_live)
    scope = ProbeScope(pid=pid, domain=probes.domain, torch_version=torch_version,
                       cuda_runtime_version=cuda_version, driver_version=driver,
                       world_size=probes.world_size,
                       workers_in_process=probes.workers_in_process, nvml_sees_process=sees,
                       synchronized=synchronized, cache_returned=cache_returned,
                       settled_seconds=settled, read_window_seconds=window)
    return MemorySample(allocator=allocator, device=device, host=host, scope=scope)


def _call(what: str, fn: Callable[[], None], notes: list[str]) -> bool:
    """``fn()``; False (and a note) when it raised."""
    before = len(notes)
    guarded(what, fn, notes)
    return len(notes) == before


def _read_device_side(
    probes: ProbeSet, cuda_live: bool, pid: int, notes: list[str]
) -> tuple[AllocatorReport, DeviceReport | None, str | None, bool | None]:
    """Allocator first, then the device: torch's reserved right before device used."""
    domain = probes.domain
    if domain is MemoryDomain.CUDA:
        if probes.cuda is None:
            why = "torch.cuda not importable in this process"
        elif not cuda_live:
            elsewhere = probes.workers_in_process is False or (probes.world_size or 1) > 1
            why = (f"CUDA is not initialized in this process (pid {pid})"
                   + (": the model runs in worker processes, whose allocator counters are "
                      "not visible from here" if elsewhere else ""))
        else:
            allocator = read_cuda_allocator(probes.cuda)
            allocator = allocator.model_copy(
                update={"unavailable": notes + list(allocator.unavailable)})
            nvml, nvml_why = probes.nvml()
            reading = read_device(probes.cuda, nvml, reserved=allocator.reserved_bytes,
                                  pid=pid, nvml_unavailable=nvml_why)
            return allocator, reading.report, reading.driver_version, reading.nvml_sees_process
        return (AllocatorReport(domain=domain, unavailable=[f"allocator: {why}"]),
                DeviceReport(unavailable=[f"device: {why}"]), None, None)
    if domain is MemoryDomain.MPS:
        if probes.mps is None:
            return (AllocatorReport(domain=domain, unavailable=["allocator: torch.mps not "
                                                                "importable"]), None, None, None)
        allocator = read_mps_allocator(probes.mps)
        return (allocator.model_copy(update={"unavailable": notes + list(allocator.unavailable)}),
                DeviceReport(unavailable=["device: unified memory (no separate device "
                                          "memory); see host swap"]), None, None)
    if domain is MemoryDomain.CPU:
        return (AllocatorReport(domain=domain, unavailable=[
                    "allocator: the CPU allocator keeps no counters; process RSS and the KV "
                    "pool bytes stand in for it"]),
                DeviceReport(unavailable=["device: CPU engine, no accelerator"]), None, None)
    return (AllocatorReport(domain=domain, unavailable=["allocator: no probe for this "
                                                        "accelerator"]),
            DeviceReport(unavailable=["device: no probe for this accelerator"]), None, None)


def _versions(probes: ProbeSet, cuda_live: bool) -> tuple[str | None, str | None]:
    if cuda_live and probes.cuda is not None:
        scratch: list[str] = []
        got = guarded("versions", probes.cuda.versions, scratch)
        if got is not None:
            return got
    if probes.mps is not None:
        return probes.mps.torch_version(), None
    torch = sys.modules.get("torch")  # never import torch just to name its version
    version = getattr(torch, "__version__", None)
    return (str(version) if version is not None else None), None
