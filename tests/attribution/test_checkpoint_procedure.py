"""The checkpoint procedure: synchronize, return cache only when asked, settle, read once."""

from __future__ import annotations

from _attr_fakes import PID, FakeCuda, FakeHost, FakeMps, FakeNvml, GiB, cpu_probes, cuda_probes

from kvguard.attribution.procedure import ProbeSet, ProcedureSettings, take_sample
from kvguard.core.report import MemoryDomain, NonTorchScope


class Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def test_default_checkpoint_synchronizes_reads_once_and_never_waits_or_empties() -> None:
    cuda = FakeCuda()
    nvml = FakeNvml(cuda)
    sleeps = Sleeps()
    s = take_sample(cuda_probes(cuda, nvml=nvml), ProcedureSettings(), sleep=sleeps)
    assert "empty_cache" not in cuda.calls and sleeps.calls == []
    assert cuda.calls.index("synchronize") < cuda.calls.index("memory_allocated")
    # torch's reserved is read right before the device's used, in the same window
    assert cuda.calls.index("memory_reserved") < cuda.calls.index("nvml.memory")
    assert nvml.calls == ["memory", "process_used"]
    assert s.scope.synchronized and not s.scope.cache_returned and s.scope.settled_seconds == 0
    assert s.scope.pid == PID and s.scope.domain is MemoryDomain.CUDA
    assert s.scope.torch_version == "2.13.0+cu128" and s.scope.cuda_runtime_version == "12.8"
    assert s.scope.driver_version == "570.124.06" and s.scope.nvml_sees_process is True
    assert s.scope.world_size == 1 and s.scope.read_window_seconds >= 0
    assert s.allocator.allocated_bytes == 74 * GiB
    assert s.device is not None and s.device.non_torch_scope is NonTorchScope.PROCESS
    assert s.host.rss_bytes == 2 * GiB


def test_cache_return_at_a_declared_checkpoint_then_settle_before_reading() -> None:
    cuda = FakeCuda()
    sleeps = Sleeps()
    s = take_sample(cuda_probes(cuda), ProcedureSettings(empty_cache=True, settle_seconds=0.5),
                    sleep=sleeps)
    assert cuda.calls.index("synchronize") < cuda.calls.index("empty_cache") \
        < cuda.calls.index("memory_allocated")
    assert sleeps.calls == [0.5]
    assert s.scope.cache_returned and s.scope.settled_seconds == 0.5


def test_a_failed_cache_return_does_not_wait() -> None:
    cuda = FakeCuda(fail={"empty_cache": RuntimeError("busy")})
    sleeps = Sleeps()
    s = take_sample(cuda_probes(cuda), ProcedureSettings(empty_cache=True), sleep=sleeps)
    assert sleeps.calls == [] and not s.scope.cache_returned
    assert any(u.startswith("empty_cache") for u in s.allocator.unavailable)


def test_a_process_without_a_cuda_context_is_not_given_one() -> None:
    cuda = FakeCuda(initialized=False)
    probes = cuda_probes(cuda)
    probes.world_size = 4
    s = take_sample(probes, ProcedureSettings(empty_cache=True))
    assert cuda.calls == ["is_initialized"]  # no synchronize, no empty_cache, no reads
    assert s.allocator.allocated_bytes is None
    assert "the model runs in worker processes" in s.allocator.unavailable[0]
    assert s.device is not None and s.device.used_bytes is None
    assert not s.scope.synchronized


def test_mps_synchronizes_and_returns_cache_through_torch_mps() -> None:
    mps = FakeMps()
    probes = ProbeSet(domain=MemoryDomain.MPS, host=FakeHost(platform="darwin", files={},
                                                             rss=1 * GiB), mps=mps)
    s = take_sample(probes, ProcedureSettings(empty_cache=True, settle_seconds=0.0))
    assert mps.calls == ["synchronize", "empty_cache"]
    assert s.allocator.domain is MemoryDomain.MPS and s.allocator.reserved_bytes is not None
    assert s.scope.torch_version == "2.14.0"


def test_cpu_engine_reads_the_host_and_says_the_allocator_has_no_counters() -> None:
    sleeps = Sleeps()
    s = take_sample(cpu_probes(FakeHost()), ProcedureSettings(empty_cache=True), sleep=sleeps)
    assert s.scope.domain is MemoryDomain.CPU
    assert not s.scope.cache_returned and sleeps.calls == []  # nothing released, no wait
    assert s.allocator.allocated_bytes is None and "no counters" in s.allocator.unavailable[0]
    assert s.host.rss_bytes == 2 * GiB
