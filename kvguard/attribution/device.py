"""Device probe: NVML (``nvidia-ml-py``) or ``torch.cuda.mem_get_info`` (bytes).

``used - torch reserved`` is memory outside the framework: the CUDA context,
NCCL buffers, CUDA graphs, direct ``cudaMalloc`` calls, and, at device
scope, other processes. When NVML lists this pid, the per-process number is
used (scope ``process``); otherwise the device total is (scope ``device``:
other processes included). In containers NVML often lists host pids, so
this process can be missing from its list even though it uses the device:
``nvml_sees_process`` records which case a checkpoint was in.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.attribution.backends import CudaBackend, NvmlBackend, PyNvml
from kvguard.attribution.reading import guarded
from kvguard.core.report import DeviceReport, DeviceSource, NonTorchScope


@dataclass(frozen=True, slots=True)
class DeviceReading:
    report: DeviceReport
    driver_version: str | None
    nvml_sees_process: bool | None
    """None when NVML was not readable."""


def open_nvml(cuda: CudaBackend | None) -> tuple[NvmlBackend | None, str | None]:
    """NVML for the current CUDA device, or ``(None, reason)``. Never raises."""
    if cuda is None:
        return None, "nvml: no CUDA device in this process"
    try:
        return PyNvml(uuid=cuda.device_uuid(), index=cuda.device_index()), None
    except ImportError:
        return None, "nvml: pynvml not installed (pip install 'kvguard[gpu]')"
    except Exception as exc:
        return None, f"nvml: {type(exc).__name__}: {exc}"[:200]


def read_device(cuda: CudaBackend | None, nvml: NvmlBackend | None, *,
                reserved: int | None, pid: int,
                nvml_unavailable: str | None = None) -> DeviceReading:
    """The device section now. ``reserved``: torch's reservation read in the same window."""
    unavailable: list[str] = [nvml_unavailable] if nvml_unavailable else []
    used = total = process_used = None
    source: DeviceSource | None = None
    driver: str | None = None
    sees: bool | None = None
    index = guarded("device_index", cuda.device_index, unavailable) if cuda else None
    if nvml is not None:
        mem = guarded("nvml memory", nvml.memory, unavailable)
        if mem is not None:
            (used, total), source = mem, DeviceSource.NVML
        procs = guarded("nvml processes", nvml.process_used, unavailable)
        if procs is not None:
            sees = pid in procs
            process_used = procs.get(pid)
            if not sees:
                unavailable.append(f"nvml process used: pid {pid} not in NVML's list (a "
                                   "container may see host pids); non_torch is device-wide")
            elif process_used is None:
                unavailable.append("nvml process used: NVML lists the pid without a number")
        driver = guarded("nvml driver version", nvml.driver_version, unavailable)
    if used is None and cuda is not None:
        info = guarded("mem_get_info", cuda.mem_get_info, unavailable)
        if info is not None:
            free, total = info
            used, source = total - free, DeviceSource.CUDA_MEM_GET_INFO
    non_torch = scope = None
    if reserved is not None:
        if process_used is not None:
            non_torch, scope = process_used - reserved, NonTorchScope.PROCESS
        elif used is not None:
            non_torch, scope = used - reserved, NonTorchScope.DEVICE
    if non_torch is None:
        unavailable.append("non_torch: needs device used and torch reserved")
    report = DeviceReport(used_bytes=used, total_bytes=total, non_torch_bytes=non_torch,
                          source=source, device_index=index, process_used_bytes=process_used,
                          non_torch_scope=scope, unavailable=unavailable)
    return DeviceReading(report, driver, sees)
