"""Fake backends that return recorded counters, for the probe and attribution logic.

The numbers are shaped like an H100 serving a 7B model under vLLM: a KV pool of
about 60 GiB allocated once, weights of 13.5 GiB, a CUDA context and NCCL of
a few hundred MiB outside torch. Each fake records the calls it received, so
tests can check the checkpoint procedure's order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from kvguard.attribution.procedure import ProbeSet
from kvguard.core.report import MemoryDomain, PoolReport

MiB = 1 << 20
GiB = 1 << 30
PID = os.getpid()


@dataclass(frozen=True)
class CudaCounters:
    """One recorded reading of the CUDA allocator and the device (bytes)."""

    allocated: int = 74 * GiB
    reserved: int = 75 * GiB
    inactive_split: int = 200 * MiB
    active: int | None = None
    peak: int = 76 * GiB
    retries: int = 0
    ooms: int = 0
    device_used: int = 75 * GiB + 600 * MiB
    """NVML device used: reserved + context/NCCL (+ other processes)."""
    process_used: int | None = 75 * GiB + 500 * MiB
    total: int = 80 * GiB

    def but(self, **changes: int | None) -> CudaCounters:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass
class FakeCuda:
    """A ``CudaBackend`` whose counters tests move between checkpoints."""

    counters: CudaCounters = field(default_factory=CudaCounters)
    initialized: bool = True
    backend: str = "native"
    stats_keys: tuple[str, ...] | None = None
    """Only these memory_stats keys (None: all). cudaMallocAsync reports fewer."""
    fail: dict[str, Exception] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    def is_initialized(self) -> bool:
        self._call("is_initialized")
        return self.initialized

    def synchronize(self) -> None:
        self._call("synchronize")

    def empty_cache(self) -> None:
        self._call("empty_cache")

    def memory_allocated(self) -> int:
        self._call("memory_allocated")
        return self.counters.allocated

    def memory_reserved(self) -> int:
        self._call("memory_reserved")
        return self.counters.reserved

    def memory_stats(self) -> Mapping[str, int]:
        self._call("memory_stats")
        c = self.counters
        stats = {
            "allocated_bytes.all.current": c.allocated,
            "allocated_bytes.all.peak": c.peak,
            "reserved_bytes.all.current": c.reserved,
            "active_bytes.all.current": c.active if c.active is not None else c.allocated,
            "inactive_split_bytes.all.current": c.inactive_split,
            "num_alloc_retries": c.retries,
            "num_ooms": c.ooms,
        }
        if self.stats_keys is not None:
            stats = {k: v for k, v in stats.items() if k in self.stats_keys}
        return stats

    def allocator_backend(self) -> str:
        self._call("allocator_backend")
        return self.backend

    def mem_get_info(self) -> tuple[int, int]:
        self._call("mem_get_info")
        return self.counters.total - self.counters.device_used, self.counters.total

    def device_index(self) -> int:
        return 0

    def device_uuid(self) -> str | None:
        return "GPU-8f5a2d3c-0000-1111-2222-333344445555"

    def versions(self) -> tuple[str | None, str | None]:
        return "2.13.0+cu128", "12.8"


@dataclass
class FakeNvml:
    """An ``NvmlBackend`` reading the same recorded counters as a ``FakeCuda``."""

    cuda: FakeCuda
    pid_visible: bool = True
    other_processes: dict[int, int | None] = field(default_factory=lambda: {9001: 2 * GiB})
    calls: list[str] = field(default_factory=list)

    def driver_version(self) -> str | None:
        return "570.124.06"

    def memory(self) -> tuple[int, int]:
        self.calls.append("memory")
        self.cuda.calls.append("nvml.memory")
        c = self.cuda.counters
        return c.device_used, c.total

    def process_used(self) -> Mapping[int, int | None]:
        self.calls.append("process_used")
        procs = dict(self.other_processes)
        if self.pid_visible:
            procs[PID] = self.cuda.counters.process_used
        return procs


@dataclass
class FakeMps:
    allocated: int = 4 * GiB
    driver: int = 4 * GiB + 256 * MiB
    calls: list[str] = field(default_factory=list)

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def current_allocated_memory(self) -> int:
        return self.allocated

    def driver_allocated_memory(self) -> int:
        return self.driver

    def torch_version(self) -> str | None:
        return "2.14.0"


LINUX_MEMINFO = """\
MemTotal:       131900544 kB
MemFree:         3123456 kB
MemAvailable:   41234560 kB
Buffers:          123456 kB
Cached:         38123456 kB
SwapCached:        10240 kB
SwapTotal:       8388604 kB
SwapFree:        8126460 kB
Zswap:                 0 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""
"""SwapTotal - SwapFree = 262144 kB = 256 MiB."""

LINUX_STATUS = """\
Name:\tpython
Pid:\t4242
VmPeak:\t 9876544 kB
VmHWM:\t 2111111 kB
VmRSS:\t 2097152 kB
RssAnon:\t 1900000 kB
VmSwap:\t       0 kB
Threads:\t37
"""
"""VmRSS 2097152 kB = 2 GiB."""


@dataclass
class FakeHost:
    """A ``HostBackend`` serving recorded procfs / sysctl text."""

    platform: str = "linux"
    page_size: int = 4096
    files: dict[str, str] = field(default_factory=lambda: {
        "/proc/meminfo": LINUX_MEMINFO, "/proc/self/status": LINUX_STATUS})
    sysctls: dict[str, str] = field(default_factory=dict)
    rss: int | None = None
    peak: int | None = 3 * GiB
    children: dict[int, int] = field(default_factory=dict)

    def read_text(self, path: str) -> str | None:
        return self.files.get(path)

    def sysctl(self, name: str) -> str | None:
        return self.sysctls.get(name)

    def max_rss_bytes(self) -> int | None:
        return self.peak

    def process_rss_bytes(self) -> int | None:
        return self.rss

    def child_pids(self) -> list[int]:
        return sorted(self.children)

    def set_children(self, rss_by_pid: dict[int, int]) -> None:
        """Worker processes (pid -> RSS bytes) and their procfs status text."""
        self.children = dict(rss_by_pid)
        for pid, rss in rss_by_pid.items():
            self.files[f"/proc/{pid}/status"] = f"Name:\tVLLM::Worker\nVmRSS:\t{rss // 1024} kB\n"

    def set_linux(self, *, rss: int, swap_used: int, available: int = 40 * GiB,
                  swap_total: int = 8 * GiB) -> None:
        """Rewrite the procfs text for the given numbers (bytes, multiples of KiB)."""
        self.files["/proc/self/status"] = f"Name:\tpython\nVmRSS:\t{rss // 1024} kB\n"
        swap_free = swap_total - swap_used
        self.files["/proc/meminfo"] = (
            f"MemTotal: {128 * GiB // 1024} kB\nMemAvailable: {available // 1024} kB\n"
            f"SwapTotal: {swap_total // 1024} kB\nSwapFree: {swap_free // 1024} kB\n")


def cuda_probes(cuda: FakeCuda, *, nvml: FakeNvml | None = None, host: FakeHost | None = None,
                nvml_missing: str | None = None) -> ProbeSet:
    def opener(_: object) -> tuple[FakeNvml | None, str | None]:
        return (None, nvml_missing) if nvml is None else (nvml, None)

    return ProbeSet(domain=MemoryDomain.CUDA, host=host or FakeHost(), cuda=cuda,
                    world_size=1, nvml_opener=opener)  # type: ignore[arg-type]


def cpu_probes(host: FakeHost) -> ProbeSet:
    return ProbeSet(domain=MemoryDomain.CPU, host=host, world_size=1)


def pool(capacity: int = 63, *, held: int = 0, orphaned: int = 0, cached: int = 10) -> PoolReport:
    return PoolReport(capacity=capacity, free=capacity - held - orphaned - cached, cached=cached,
                      active=0, held_by_finished=held, orphaned=orphaned,
                      num_free_reported=capacity - held - orphaned)


Sleep = Callable[[float], None]
