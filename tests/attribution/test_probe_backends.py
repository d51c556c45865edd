"""Allocator and device probes against fake backends (recorded numbers), and the adapters."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from _attr_fakes import PID, CudaCounters, FakeCuda, FakeMps, FakeNvml, GiB, MiB

from kvguard.attribution.allocator import read_cuda_allocator, read_mps_allocator
from kvguard.attribution.backends import PyNvml, TorchCuda
from kvguard.attribution.device import open_nvml, read_device
from kvguard.core.report import DeviceSource, MemoryDomain, NonTorchScope


def test_cuda_allocator_reads_every_counter() -> None:
    cuda = FakeCuda(CudaCounters(allocated=74 * GiB, reserved=75 * GiB,
                                 inactive_split=200 * MiB, active=74 * GiB + 8 * MiB,
                                 peak=76 * GiB, retries=2, ooms=1))
    a = read_cuda_allocator(cuda)
    assert a.domain is MemoryDomain.CUDA and a.backend == "native"
    assert (a.allocated_bytes, a.reserved_bytes) == (74 * GiB, 75 * GiB)
    assert a.reserved_unallocated_bytes == 1 * GiB
    assert a.inactive_split_bytes == 200 * MiB and a.active_bytes == 74 * GiB + 8 * MiB
    assert a.peak_allocated_bytes == 76 * GiB
    assert (a.num_alloc_retries, a.num_ooms) == (2, 1)
    assert a.unavailable == []


def test_cuda_malloc_async_backend_lists_the_statistics_it_lacks() -> None:
    cuda = FakeCuda(backend="cudaMallocAsync",
                    stats_keys=("allocated_bytes.all.current", "reserved_bytes.all.current",
                                "num_ooms"))
    a = read_cuda_allocator(cuda)
    assert a.backend == "cudaMallocAsync"
    assert a.allocated_bytes is not None and a.num_ooms == 0
    assert a.inactive_split_bytes is None and a.num_alloc_retries is None
    missing = {u.split(":")[0] for u in a.unavailable}
    assert missing == {"active_bytes.all.current", "inactive_split_bytes.all.current",
                       "allocated_bytes.all.peak", "num_alloc_retries"}
    assert all("cudaMallocAsync" in u for u in a.unavailable)


def test_one_failing_counter_does_not_lose_the_others() -> None:
    cuda = FakeCuda(fail={"memory_stats": RuntimeError("CUDA error: misaligned address"),
                          "allocator_backend": AttributeError("no _cuda_getAllocatorBackend")})
    a = read_cuda_allocator(cuda)
    assert a.allocated_bytes == 74 * GiB and a.reserved_bytes == 75 * GiB
    assert a.backend is None and a.inactive_split_bytes is None
    assert [u.split(":")[0] for u in a.unavailable] == ["memory_stats", "allocator_backend"]


def test_mps_maps_current_to_allocated_and_driver_to_reserved() -> None:
    a = read_mps_allocator(FakeMps(allocated=4 * GiB, driver=4 * GiB + 256 * MiB))
    assert a.domain is MemoryDomain.MPS
    assert a.allocated_bytes == 4 * GiB and a.reserved_unallocated_bytes == 256 * MiB
    assert any("MPS reports no such statistics" in u for u in a.unavailable)


def test_device_with_nvml_seeing_this_process_uses_the_process_number() -> None:
    cuda = FakeCuda()
    r = read_device(cuda, FakeNvml(cuda), reserved=75 * GiB, pid=PID)
    d = r.report
    assert d.source is DeviceSource.NVML and d.non_torch_scope is NonTorchScope.PROCESS
    assert d.used_bytes == 75 * GiB + 600 * MiB and d.total_bytes == 80 * GiB
    assert d.process_used_bytes == 75 * GiB + 500 * MiB
    assert d.non_torch_bytes == 500 * MiB  # context + NCCL of this process, not the 2 GiB peer
    assert r.nvml_sees_process is True and r.driver_version == "570.124.06"
    assert d.unavailable == []


def test_device_in_a_container_where_nvml_lists_host_pids_falls_back_to_device_scope() -> None:
    cuda = FakeCuda()
    r = read_device(cuda, FakeNvml(cuda, pid_visible=False), reserved=75 * GiB, pid=PID)
    assert r.nvml_sees_process is False
    assert r.report.non_torch_scope is NonTorchScope.DEVICE
    assert r.report.non_torch_bytes == 600 * MiB
    assert any("host pids" in u for u in r.report.unavailable)


def test_device_without_nvml_uses_mem_get_info() -> None:
    cuda = FakeCuda()
    r = read_device(cuda, None, reserved=75 * GiB, pid=PID,
                    nvml_unavailable="nvml: pynvml not installed")
    assert r.report.source is DeviceSource.CUDA_MEM_GET_INFO
    assert r.report.used_bytes == 75 * GiB + 600 * MiB
    assert r.report.non_torch_scope is NonTorchScope.DEVICE
    assert r.nvml_sees_process is None
    assert r.report.unavailable == ["nvml: pynvml not installed"]


def test_device_without_reserved_cannot_say_what_is_outside_torch() -> None:
    cuda = FakeCuda()
    r = read_device(cuda, None, reserved=None, pid=PID)
    assert r.report.used_bytes is not None and r.report.non_torch_bytes is None
    assert any(u.startswith("non_torch") for u in r.report.unavailable)


def test_open_nvml_without_pynvml_is_unavailable_not_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    nvml, why = open_nvml(FakeCuda())
    assert nvml is None and why is not None and "pynvml not installed" in why
    assert open_nvml(None) == (None, "nvml: no CUDA device in this process")


def _fake_pynvml(*, init_error: Exception | None = None) -> Any:
    m = types.ModuleType("pynvml")
    state: dict[str, Any] = {"uuid": None, "index": None}

    def nvmlInit() -> None:
        if init_error is not None:
            raise init_error

    def by_uuid(uuid: str) -> str:
        state["uuid"] = uuid
        return "handle"

    def by_index(i: int) -> str:
        state["index"] = i
        return "handle"

    m.nvmlInit = nvmlInit  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByUUID = by_uuid  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = by_index  # type: ignore[attr-defined]
    m.nvmlSystemGetDriverVersion = lambda: b"570.124.06"  # type: ignore[attr-defined]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        used=70 * GiB, total=80 * GiB, free=10 * GiB)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        types.SimpleNamespace(pid=PID, usedGpuMemory=69 * GiB),
        types.SimpleNamespace(pid=7, usedGpuMemory=None)]
    m.state = state  # type: ignore[attr-defined]
    return m


def test_pynvml_adapter_finds_the_device_by_uuid_and_translates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nvml, why = open_nvml(FakeCuda())
    assert why is None and isinstance(nvml, PyNvml)
    assert fake.state["uuid"] == "GPU-8f5a2d3c-0000-1111-2222-333344445555"
    assert nvml.driver_version() == "570.124.06"
    assert nvml.memory() == (70 * GiB, 80 * GiB)
    assert nvml.process_used() == {PID: 69 * GiB, 7: None}
    by_index = PyNvml(uuid=None, index=3)
    assert by_index is not None and fake.state["index"] == 3


def test_nvml_init_failure_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml",
                        _fake_pynvml(init_error=RuntimeError("NVML Shared Library Not Found")))
    nvml, why = open_nvml(FakeCuda())
    assert nvml is None and why == "nvml: RuntimeError: NVML Shared Library Not Found"


def test_the_real_torch_cuda_adapter_on_this_cpu_machine_creates_no_context() -> None:
    cuda = TorchCuda()  # real torch (a CPU build here)
    assert cuda.is_initialized() is False
