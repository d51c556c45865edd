"""What the probes read from: tiny protocols, and the real adapters behind them.

Every probe takes one of these objects instead of importing torch or pynvml
itself, so the probe logic runs on any machine against a fake backend that
returns recorded numbers; the real adapters are thin and only translate
calls. Units: bytes everywhere.

Import rules: nothing here imports torch or pynvml at module import time.
The real adapters import them on construction (``importlib``: both stay
``Any`` for the type checker), and a missing module means "unavailable",
never an exception into the engine.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any, Protocol


class CudaBackend(Protocol):
    """The subset of ``torch.cuda`` the CUDA probes use (one device: the current one)."""

    def is_initialized(self) -> bool:
        """True once this process has a CUDA context. Probes never create one."""
        ...

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...

    def memory_allocated(self) -> int: ...

    def memory_reserved(self) -> int: ...

    def memory_stats(self) -> Mapping[str, int]:
        """Flat ``torch.cuda.memory_stats()`` keys, e.g. ``active_bytes.all.current``."""
        ...

    def allocator_backend(self) -> str:
        """``native`` or ``cudaMallocAsync``."""
        ...

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the whole device (every process on it)."""
        ...

    def device_index(self) -> int: ...

    def device_uuid(self) -> str | None:
        """NVML-style UUID (``GPU-...``) of the current device, if torch knows it."""
        ...

    def versions(self) -> tuple[str | None, str | None]:
        """``(torch version, CUDA runtime version)``."""
        ...


class MpsBackend(Protocol):
    """The subset of ``torch.mps`` the MPS probe uses."""

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...

    def current_allocated_memory(self) -> int: ...

    def driver_allocated_memory(self) -> int: ...

    def torch_version(self) -> str | None: ...


class NvmlBackend(Protocol):
    """NVML for one device (``nvidia-ml-py``)."""

    def driver_version(self) -> str | None: ...

    def memory(self) -> tuple[int, int]:
        """``(used, total)`` bytes of the device."""
        ...

    def process_used(self) -> Mapping[int, int | None]:
        """pid -> used bytes of every compute process NVML lists (None: not reported).

        In a container NVML may list host pids, so this process can be missing.
        """
        ...


class HostBackend(Protocol):
    """Raw host sources; the parsing lives in ``kvguard.attribution.host``."""

    platform: str
    """``sys.platform``: ``linux``, ``darwin``, ..."""

    page_size: int
    """Bytes per memory page (``/proc/<pid>/statm`` counts pages)."""

    def read_text(self, path: str) -> str | None:
        """A small procfs file (``/proc/meminfo``, ``/proc/self/status``), or None."""
        ...

    def sysctl(self, name: str) -> str | None:
        """``sysctl -n <name>`` output (macOS), or None."""
        ...

    def max_rss_bytes(self) -> int | None:
        """``getrusage`` peak RSS in bytes (Linux reports KiB, macOS bytes)."""
        ...

    def process_rss_bytes(self) -> int | None:
        """Current RSS where there is no procfs (``psutil`` if installed), or None."""
        ...

    def child_pids(self) -> list[int]:
        """Direct children of this process (Linux procfs), or [] where unknown."""
        ...


class MemoryHistoryBackend(Protocol):
    """PyTorch's CUDA memory history (stacks of framework allocations, no contents)."""

    def start(self, max_entries: int) -> None: ...

    def dump(self, path: str) -> None: ...


# ----------------------------------------------------------------- real adapters
def _import(name: str) -> Any:
    return importlib.import_module(name)


class TorchCuda:
    """``torch.cuda`` behind ``CudaBackend``. Construct only where torch is importable."""

    def __init__(self) -> None:
        self._torch = _import("torch")
        self._cuda = self._torch.cuda

    def is_initialized(self) -> bool:
        return bool(self._cuda.is_initialized() and self._cuda.is_available())

    def synchronize(self) -> None:
        self._cuda.synchronize()

    def empty_cache(self) -> None:
        self._cuda.empty_cache()

    def memory_allocated(self) -> int:
        return int(self._cuda.memory_allocated())

    def memory_reserved(self) -> int:
        return int(self._cuda.memory_reserved())

    def memory_stats(self) -> Mapping[str, int]:
        return {str(k): int(v) for k, v in self._cuda.memory_stats().items()}

    def allocator_backend(self) -> str:
        return str(self._cuda.get_allocator_backend())

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._cuda.mem_get_info()
        return int(free), int(total)

    def device_index(self) -> int:
        return int(self._cuda.current_device())

    def device_uuid(self) -> str | None:
        props = self._cuda.get_device_properties(self._cuda.current_device())
        uuid = getattr(props, "uuid", None)
        if uuid is None:
            return None
        text = str(uuid)
        return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"

    def versions(self) -> tuple[str | None, str | None]:
        return str(self._torch.__version__), getattr(self._torch.version, "cuda", None)


class TorchMps:
    """``torch.mps`` behind ``MpsBackend``."""

    def __init__(self) -> None:
        self._torch = _import("torch")
        self._mps = self._torch.mps

    def synchronize(self) -> None:
        self._mps.synchronize()

    def empty_cache(self) -> None:
        self._mps.empty_cache()

    def current_allocated_memory(self) -> int:
        return int(self._mps.current_allocated_memory())

    def driver_allocated_memory(self) -> int:
        return int(self._mps.driver_allocated_memory())

    def torch_version(self) -> str | None:
        return str(self._torch.__version__)


class PyNvml:
    """``pynvml`` (package ``nvidia-ml-py``) for one device, behind ``NvmlBackend``.

    The device is found by UUID when torch gives one (CUDA and NVML number
    devices differently under ``CUDA_VISIBLE_DEVICES``), else by index.
    Raises on construction when NVML cannot be opened; callers turn that into
    an ``unavailable`` entry.
    """

    def __init__(self, *, uuid: str | None, index: int) -> None:
        self._nv = _import("pynvml")
        self._nv.nvmlInit()
        if uuid is not None:
            self._handle = self._nv.nvmlDeviceGetHandleByUUID(uuid)
        else:
            self._handle = self._nv.nvmlDeviceGetHandleByIndex(index)

    def driver_version(self) -> str | None:
        v = self._nv.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)

    def memory(self) -> tuple[int, int]:
        info = self._nv.nvmlDeviceGetMemoryInfo(self._handle)
        return int(info.used), int(info.total)

    def process_used(self) -> Mapping[int, int | None]:
        out: dict[int, int | None] = {}
        for p in self._nv.nvmlDeviceGetComputeRunningProcesses(self._handle):
            used = getattr(p, "usedGpuMemory", None)
            out[int(p.pid)] = int(used) if isinstance(used, int) else None
        return out


class SystemHost:
    """This machine's procfs, ``sysctl`` and ``getrusage`` behind ``HostBackend``."""

    def __init__(self) -> None:
        self.platform = sys.platform
        self.page_size = _page_size()

    def read_text(self, path: str) -> str | None:
        # os-level, not open(): no buffered text wrapper for one small procfs read (it
        # runs at every drained checkpoint, on the engine thread).
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            return os.read(fd, 65536).decode("ascii", "replace")
        except OSError:
            return None
        finally:
            os.close(fd)

    def sysctl(self, name: str) -> str | None:
        import subprocess

        try:
            out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                                 timeout=2.0, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout

    def max_rss_bytes(self) -> int | None:
        try:
            import resource
        except ImportError:  # pragma: no cover - Windows
            return None
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return peak if self.platform == "darwin" else peak * 1024

    def process_rss_bytes(self) -> int | None:
        try:
            psutil = _import("psutil")
        except ImportError:
            return None
        return int(psutil.Process().memory_info().rss)

    def child_pids(self) -> list[int]:
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return []
        pids: set[int] = set()
        for tid in tasks:
            text = self.read_text(f"/proc/self/task/{tid}/children") or ""
            pids.update(int(p) for p in text.split() if p.isdigit())
        return sorted(pids)


class TorchMemoryHistory:
    """``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``.

    Python stacks of allocations only (``context="alloc"``): a snapshot names
    who allocated each live block, with sizes and addresses, never contents.
    """

    def __init__(self) -> None:
        self._memory = _import("torch").cuda.memory

    def start(self, max_entries: int) -> None:
        self._memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                            max_entries=max_entries)

    def dump(self, path: str) -> None:
        self._memory._dump_snapshot(path)
        os.chmod(path, 0o600)


def _page_size() -> int:
    """This machine's memory page size in bytes (4096 where it cannot be asked)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - no sysconf
        return 4096
